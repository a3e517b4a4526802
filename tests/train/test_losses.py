"""Policy losses: worked values for every variant, gradient directions, micro-batch invariance."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rollshard.train.config import LossConfig
from rollshard.train.losses import (
    KL_K3_CLAMP,
    LOG_RATIO_CLAMP,
    LossNorm,
    effective_sample_size,
    kl_penalty,
    policy_loss,
)

L = math.log


def cfg(**kw) -> LossConfig:
    return LossConfig(**kw)


def run(log_ratio, adv, mask, cu, config, *, rollout=None, **kw):
    """Loss and d loss / d logp for logp = rollout + log_ratio."""
    rollout = torch.full((len(log_ratio),), -1.0) if rollout is None else rollout
    logp = (rollout + torch.tensor(log_ratio)).requires_grad_(True)
    loss, metrics = policy_loss(
        logp,
        rollout_logp=rollout,
        advantages=torch.tensor(adv),
        loss_mask=torch.tensor(mask),
        cu_seqlens=torch.tensor(cu),
        config=config,
        **kw,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, metrics


# Two sequences: seq0 = [prompt, r=1.5, r=0.5] with A=+1; seq1 = [prompt, r=1.1, r=4.0, r=1.0] with A=-1.
LR7 = [0.0, L(1.5), L(0.5), 0.0, L(1.1), L(4.0), 0.0]
ADV7 = [0.0, 1.0, 1.0, 0.0, -1.0, -1.0, -1.0]
MASK7 = [0.0, 1, 1, 0, 1, 1, 1]
CU7 = [0, 3, 7]
# Per-token PPO loss max(-rA, -clip(r, 0.8, 1.28)A), dual clip c=3 for A<0:
#   r=1.5,A=+1: max(-1.5, -1.28) = -1.28 (clipped high, no grad)
#   r=0.5,A=+1: max(-0.5, -0.8)  = -0.5  (grad -A r = -0.5)
#   r=1.1,A=-1: 1.1                      (grad +1.1)
#   r=4.0,A=-1: max(4.0, 1.28)=4.0 -> dual clip min(4.0, 3.0) = 3.0 (no grad)
#   r=1.0,A=-1: 1.0                      (grad +1.0)
PG7 = [-1.28, -0.5, 1.1, 3.0, 1.0]  # sum 3.32


def test_token_mean_worked_value_and_gradient():
    loss, grad, m = run(LR7, ADV7, MASK7, CU7, cfg())
    assert loss.item() == pytest.approx(3.32 / 5, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([0, 0, -0.5, 0, 1.1, 0, 1.0]) / 5, atol=1e-6, rtol=0)
    assert m["clip/frac_high"].item() == pytest.approx(1 / 5)
    assert m["clip/frac_low"].item() == 0.0
    assert m["clip/frac_dual"].item() == pytest.approx(1 / 5)
    assert m["ratio/max"].item() == pytest.approx(4.0, rel=1e-6)
    assert m["ratio/min"].item() == pytest.approx(0.5, rel=1e-6)
    assert m["tokens"].item() == 5


def test_dual_clip_off():
    loss, grad, _ = run(LR7, ADV7, MASK7, CU7, cfg(dual_clip_c=None))
    assert loss.item() == pytest.approx((3.32 + 1.0) / 5, abs=1e-6)  # r=4.0 token keeps loss 4.0 and its gradient
    assert grad[5].item() == pytest.approx(4.0 / 5, abs=1e-6)


def test_seq_mean_token_mean_worked_value():
    loss, _, _ = run(LR7, ADV7, MASK7, CU7, cfg(agg="seq-mean-token-mean"))
    # seq0: (-1.28 - 0.5) / 2 = -0.89; seq1: (1.1 + 3.0 + 1.0) / 3 = 1.7; mean over 2 sequences = 0.405
    assert loss.item() == pytest.approx(0.405, abs=1e-6)


def test_seq_mean_token_sum_norm_worked_value():
    loss, _, _ = run(LR7, ADV7, MASK7, CU7, cfg(agg="seq-mean-token-sum-norm"))
    assert loss.item() == pytest.approx(3.32 / (2 * 3), abs=1e-6)  # 2 sequences x longest response 3
    loss, _, _ = run(LR7, ADV7, MASK7, CU7, cfg(agg="seq-mean-token-sum-norm", norm_len=10))
    assert loss.item() == pytest.approx(3.32 / (2 * 10), abs=1e-6)


def test_clipping_direction_for_positive_and_negative_advantages():
    # One token per sequence; eps 0.2 / 0.28.
    lr = [L(1.5), L(0.5), L(0.5), L(1.5)]
    adv = [1.0, 1.0, -1.0, -1.0]
    loss, grad, m = run(lr, adv, [1.0] * 4, [0, 1, 2, 3, 4], cfg())
    # A>0: ratio above 1+eps_high is clipped (no push further up); below 1-eps_low it still gets pushed up.
    # A<0: ratio below 1-eps_low is clipped (no push further down); above 1+eps_high it still gets pushed down.
    # losses: -1.28, -0.5, max(0.5, 0.8) = 0.8, 1.5
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5) / 4, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([0.0, -0.5, 0.0, 1.5]) / 4, atol=1e-6, rtol=0)
    assert m["clip/frac_high"].item() == pytest.approx(0.25)
    assert m["clip/frac_low"].item() == pytest.approx(0.25)


@pytest.mark.parametrize("mode", ["bypass", "decoupled"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_zero_advantage_gives_zero_policy_gradient(mode, level):
    g = torch.Generator().manual_seed(0)
    lr = (torch.randn(8, generator=g) * 0.5).tolist()
    prox = torch.full((8,), -0.7)
    _, grad, _ = run(lr, [0.0] * 8, [1.0] * 8, [0, 3, 8], cfg(mode=mode, ratio_level=level), prox_logp=prox)
    assert grad.abs().max().item() == 0.0


def test_ratio_one_at_equal_logprobs():
    _, _, m = run([0.0] * 7, ADV7, MASK7, CU7, cfg())
    assert m["ratio/mean"].item() == 1.0 and m["ratio/min"].item() == 1.0 and m["ratio/max"].item() == 1.0
    assert m["clip/frac_low"].item() == 0.0 and m["clip/frac_high"].item() == 0.0
    assert m["mismatch/abs_diff_max"].item() == 0.0 and m["mismatch/k3_kl"].item() == 0.0


def test_mismatch_metrics_worked_values():
    # |logp - rollout| = [log 2, log 2] -> mean = max = 0.693147; k3 of KL(rollout || pi) with u = pi/pi_rollout:
    # u - 1 - log u: u=2 -> 1 - 0.693147 = 0.306853; u=0.5 -> -0.5 + 0.693147 = 0.193147; mean 0.25
    _, _, m = run([L(2.0), -L(2.0)], [1.0, 1.0], [1.0, 1.0], [0, 2], cfg())
    assert m["mismatch/abs_diff_mean"].item() == pytest.approx(L(2.0), abs=1e-6)
    assert m["mismatch/k3_kl"].item() == pytest.approx(0.25, abs=1e-6)


def _split_grad(agg):
    """Gradient of the whole batch vs the sum over two micro-batches normalized by the global counts."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 2, 7, 4]
    T = sum(lengths)
    rollout = -torch.rand(T, generator=g) * 3
    logp = (rollout + torch.randn(T, generator=g) * 0.3).requires_grad_(True)
    adv = torch.randn(T, generator=g)
    mask = (torch.rand(T, generator=g) > 0.3).float()
    cu = torch.tensor([0, 5, 7, 14, 18])
    config = cfg(agg=agg)
    loss_all, _ = policy_loss(logp, rollout_logp=rollout, advantages=adv, loss_mask=mask, cu_seqlens=cu, config=config)
    (g_all,) = torch.autograd.grad(loss_all, logp)
    parts = [(slice(0, 7), torch.tensor([0, 5, 7])), (slice(7, 18), torch.tensor([0, 7, 11]))]
    norm = LossNorm.combine([LossNorm.of(mask[s], c) for s, c in parts])
    total, g_sum = 0.0, torch.zeros(T)
    for s, c in parts:
        lp = logp.detach()[s].clone().requires_grad_(True)
        loss, _ = policy_loss(
            lp, rollout_logp=rollout[s], advantages=adv[s], loss_mask=mask[s], cu_seqlens=c, config=config, norm=norm
        )
        loss.backward()
        total += loss.item()
        g_sum[s] = lp.grad
    return loss_all.item(), total, g_all, g_sum


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_split_equals_one_batch(agg):
    loss_all, loss_sum, g_all, g_sum = _split_grad(agg)
    assert loss_sum == pytest.approx(loss_all, abs=1e-6)
    torch.testing.assert_close(g_sum, g_all, atol=1e-7, rtol=1e-6)
    assert g_all.abs().sum() > 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_equals_token_level_when_tokens_share_one_ratio(agg):
    # seq0 every token at ratio 1.5 (A=+1), seq1 every token at ratio 0.7 (A=-1): GSPO s_i equals each token ratio.
    # Same clip range on both sides (GSPO's own default is 3e-4 / 4e-4).
    lr = [0.0, L(1.5), L(1.5), L(1.5), 0.0, L(0.7), L(0.7)]
    adv = [0.0, 1, 1, 1, 0, -1, -1]
    mask = [0.0, 1, 1, 1, 0, 1, 1]
    loss_t, grad_t, _ = run(lr, adv, mask, [0, 4, 7], cfg(agg=agg))
    loss_s, grad_s, _ = run(lr, adv, mask, [0, 4, 7], cfg(agg=agg, ratio_level="sequence", eps_low=0.2, eps_high=0.28))
    assert loss_s.item() == pytest.approx(loss_t.item(), abs=1e-7)
    torch.testing.assert_close(grad_s, grad_t, atol=1e-7, rtol=0)


def test_gspo_worked_value_differs_from_token_level():
    # Ratios 1.5 and 1/1.5 in one sequence: geometric mean 1 -> s = 1 -> loss = -A = -1 (token-mean).
    # Token level: max(-1.5, -1.28) = -1.28 and max(-0.6667, -0.8) = -0.6667 -> mean -0.97333.
    lr = [L(1.5), -L(1.5)]
    loss_s, grad_s, _ = run(lr, [1.0, 1.0], [1.0, 1.0], [0, 2], cfg(ratio_level="sequence"))
    loss_t, _, _ = run(lr, [1.0, 1.0], [1.0, 1.0], [0, 2], cfg())
    assert loss_s.item() == pytest.approx(-1.0, abs=1e-6)
    assert loss_t.item() == pytest.approx((-1.28 - 1 / 1.5) / 2, abs=1e-6)
    # GSPO gradient: d/dlogp_t of -A s_i * exp(logp_t - sg) / 2 = -s_i / 2 = -0.5 on each token.
    torch.testing.assert_close(grad_s, torch.tensor([-0.5, -0.5]), atol=1e-6, rtol=0)


def run_decoupled(w, correction, level="token", cu=None, **kw):
    n = len(w)
    prox = torch.full((n,), -1.0)
    rollout = prox - torch.log(torch.tensor(w))
    logp = prox.clone().requires_grad_(True)
    loss, m = policy_loss(
        logp,
        rollout_logp=rollout,
        advantages=torch.ones(n),
        loss_mask=torch.ones(n),
        cu_seqlens=torch.tensor(cu or list(range(n + 1))),
        config=cfg(mode="decoupled", is_correction=correction, is_level=level, **kw),
        prox_logp=prox,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, m


def test_tis_weight_capped_at_c():
    # w = [0.5, 1.5, 5.0], C = 2 -> used [0.5, 1.5, 2.0]; ratio 1, A = 1: loss = -(0.5 + 1.5 + 2) / 3
    loss, grad, m = run_decoupled([0.5, 1.5, 5.0], "tis", tis_c=2.0)
    assert loss.item() == pytest.approx(-4.0 / 3, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-0.5, -1.5, -2.0]) / 3, atol=1e-6, rtol=0)
    assert m["is/max"].item() == pytest.approx(2.0)
    assert m["is/frac_dropped"].item() == pytest.approx(1 / 3)


def test_mis_masks_outside_bounds():
    # [a, b] = [0.5, 2]: 0.5 and 1.5 kept, 5.0 masked to 0 -> loss -(0.5 + 1.5) / 3
    loss, grad, m = run_decoupled([0.5, 1.5, 5.0], "mis", mis_low=0.5, mis_high=2.0)
    assert loss.item() == pytest.approx(-2.0 / 3, abs=1e-6)
    assert grad[2].item() == 0.0
    assert m["is/frac_dropped"].item() == pytest.approx(1 / 3)


def test_sequence_level_importance_weights():
    # One sequence of two tokens with token weights 1.5 and 2.0: product 3.0 -> TIS at 2 -> 2.0 per token;
    # geometric mean sqrt(3) = 1.7320508 (under C).
    loss, _, _ = run_decoupled([1.5, 2.0], "tis", level="sequence", cu=[0, 2], tis_c=2.0)
    assert loss.item() == pytest.approx(-2.0, abs=1e-6)
    loss, _, _ = run_decoupled([1.5, 2.0], "tis", level="geometric", cu=[0, 2], tis_c=2.0)
    assert loss.item() == pytest.approx(-math.sqrt(3.0), abs=1e-6)
    # MIS at sequence level drops the whole sequence when the product leaves [0.5, 2].
    loss, _, _ = run_decoupled([1.5, 2.0], "mis", level="sequence", cu=[0, 2])
    assert loss.item() == 0.0


def test_decoupled_clips_on_current_over_proximal():
    # pi/pi_prox = 1.5 with A=+1 is clipped at 1.28 whatever the rollout logprob; weight w = 1 here.
    prox = torch.tensor([-1.0])
    logp = (prox + L(1.5)).requires_grad_(True)
    loss, m = policy_loss(
        logp, rollout_logp=prox, advantages=torch.ones(1), loss_mask=torch.ones(1),
        cu_seqlens=torch.tensor([0, 1]), config=cfg(mode="decoupled"), prox_logp=prox,
    )
    assert loss.item() == pytest.approx(-1.28, abs=1e-6)
    assert m["clip/frac_high"].item() == 1.0
    with pytest.raises(ValueError, match="prox_logp"):
        policy_loss(logp, rollout_logp=prox, advantages=torch.ones(1), loss_mask=torch.ones(1),
                    cu_seqlens=torch.tensor([0, 1]), config=cfg(mode="decoupled"))


@pytest.mark.parametrize("kind,expected", [("k1", L(2.0)), ("k2", 0.5 * L(2.0) ** 2), ("k3", 0.5 - 1 + L(2.0))])
def test_kl_estimators_worked_values(kind, expected):
    # logp - ref = log 2: k1 = 0.693147, k2 = 0.240227, k3 = exp(-log 2) - 1 + log 2 = 0.193147
    assert kl_penalty(torch.tensor([L(2.0)]), torch.tensor([0.0]), kind).item() == pytest.approx(expected, abs=1e-6)


def _k3_and_grad(log_ratio):
    logp = torch.tensor(log_ratio).requires_grad_(True)
    kl = kl_penalty(logp, torch.zeros(len(log_ratio)), "k3")
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    return kl.detach(), grad


def test_k3_is_clamped_at_verls_10():
    assert KL_K3_CLAMP == 10.0
    # logp - ref = -5: unclamped k3 = e^5 - 1 - 5 = 142.413159 with d/dlogp = 1 - e^5 = -147.413159;
    # clamped: the token adds 10 and no gradient. logp - ref = +5: e^-5 - 1 + 5 = 4.006738, gradient
    # 1 - e^-5 = 0.993262, under the clamp. -2.6: e^2.6 - 3.6 = 9.863738, gradient 1 - e^2.6 = -12.463738, still
    # under it (the clamp starts near -2.61 nats).
    kl, grad = _k3_and_grad([-5.0, 5.0, -2.6])
    torch.testing.assert_close(kl, torch.tensor([10.0, 4.006738, 9.863738]), atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.993262, -12.463738]), atol=1e-5, rtol=0)


def test_k3_small_differences_are_unchanged():
    lr = [-1.0, -0.3, -1e-3, 0.0, 1e-3, 0.5, 2.0]
    kl, grad = _k3_and_grad(lr)
    x = torch.tensor(lr)
    torch.testing.assert_close(kl, torch.exp(-x) - 1 + x, atol=1e-7, rtol=0)  # the unclamped estimator, in fp32
    torch.testing.assert_close(grad, 1 - torch.exp(-x), atol=1e-7, rtol=0)
    # and against exact values: k3(-1) = e - 2 = 0.7182818, k3(2) = e^-2 + 1 = 1.1353353
    assert kl[0].item() == pytest.approx(math.e - 2, abs=1e-6) and kl[-1].item() == pytest.approx(math.exp(-2) + 1, abs=1e-6)


def test_clamped_k3_in_the_loss():
    # One token, A = 1, at ratio 1 (logp = rollout = -1) and 5 nats below the reference (ref = 4), kl_coef 0.1:
    # loss = -1 + 0.1 * 10 = 0 and d loss / d logp = -1 (the policy term alone); unclamped it would be
    # -1 + 14.2413 = 13.2413 with gradient -1 - 14.7413 = -15.7413.
    loss, grad, m = run([0.0], [1.0], [1.0], [0, 1], cfg(kl_coef=0.1), ref_logp=torch.tensor([4.0]))
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert m["loss/kl"].item() == pytest.approx(10.0, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-1.0]), atol=1e-6, rtol=0)


def test_kl_and_entropy_terms_enter_the_loss():
    ref = torch.tensor([-1.0 - L(2.0)])  # logp - ref = log 2 at ratio 1
    ent = torch.tensor([0.9])
    loss, _, m = run([0.0], [1.0], [1.0], [0, 1], cfg(kl_coef=0.1, entropy_coef=0.01), ref_logp=ref, entropy=ent)
    # -1 (policy at ratio 1, A=1) + 0.1 * 0.193147 - 0.01 * 0.9
    assert loss.item() == pytest.approx(-1 + 0.1 * (0.5 - 1 + L(2.0)) - 0.009, abs=1e-6)
    assert m["loss/kl"].item() == pytest.approx(0.5 - 1 + L(2.0), abs=1e-6)
    assert m["entropy/mean"].item() == pytest.approx(0.9)


def test_log_ratio_clamp_keeps_the_loss_finite():
    loss, grad, m = run([100.0, 0.0], [-1.0, 1.0], [1.0, 1.0], [0, 2], cfg(dual_clip_c=None))
    assert math.isfinite(loss.item()) and torch.isfinite(grad).all()
    assert m["ratio/max"].item() == pytest.approx(math.exp(LOG_RATIO_CLAMP), rel=1e-5)


def test_effective_sample_size():
    assert effective_sample_size(1.0, 1.0) == 1.0  # equal weights
    assert effective_sample_size(1.0, 2.0) == 0.5  # weights [2, 0]: mean 1, mean square 2


def test_config_dataclass_is_kw_only():
    with pytest.raises(TypeError):
        LossConfig("bypass")  # type: ignore[misc]
    assert dataclasses.replace(LossConfig(), eps_high=0.3).eps_high == 0.3


def test_gspo_clips_at_its_own_small_eps():
    # One sequence, two tokens at log-ratios log 1.002 and log 1.0: s = exp(mean) = sqrt(1.002) = 1.0009995, A = +1.
    # GSPO default eps_high 4e-4: s > 1.0004 -> clipped, loss -1.0004 per token (token-mean -1.0004), no gradient.
    # With token-level eps (0.28) nothing would clip: loss -1.0009995, gradient -0.5 per token.
    lr = [L(1.002), 0.0]
    loss, grad, m = run(lr, [1.0, 1.0], [1.0, 1.0], [0, 2], cfg(ratio_level="sequence"))
    assert loss.item() == pytest.approx(-1.0004, abs=1e-7)
    assert grad.abs().max().item() == 0.0
    assert m["clip/frac_high"].item() == 1.0
    loss, grad, _ = run(lr, [1.0, 1.0], [1.0, 1.0], [0, 2], cfg(ratio_level="sequence", eps_low=0.2, eps_high=0.28))
    assert loss.item() == pytest.approx(-math.sqrt(1.002), abs=1e-7)
    torch.testing.assert_close(grad, torch.full((2,), -math.sqrt(1.002) / 2), atol=1e-7, rtol=0)
    # A < 0, s = sqrt(0.999) = 0.9994999 < 1 - 3e-4: clipped low at 0.9997 (loss +0.9997, no gradient).
    loss, grad, m = run([L(0.999), 0.0], [-1.0, -1.0], [1.0, 1.0], [0, 2], cfg(ratio_level="sequence"))
    assert loss.item() == pytest.approx(0.9997, abs=1e-7)
    assert grad.abs().max().item() == 0.0 and m["clip/frac_low"].item() == 1.0


def test_clip_range_defaults_by_ratio_level():
    assert LossConfig().clip_range() == (0.2, 0.28)
    assert LossConfig(ratio_level="sequence").clip_range() == (3e-4, 4e-4)
    assert LossConfig(ratio_level="sequence", eps_high=0.01).clip_range() == (3e-4, 0.01)
    assert LossConfig(eps_low=0.1).clip_range() == (0.1, 0.28)

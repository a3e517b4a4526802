"""Off-policy corrections (rollshard.train.corrections, applied by policy_loss): worked values of every surrogate
and mask, their edges (all tokens dropped, one-token sequences, one-member groups, no loss token), the
normalizer and the gradient under a mask, micro-batch invariance (and M2PO's per-micro-batch pooling), the
flags and YAML keys that turn them on, and one rollshard-train step whose mask metrics are known in advance."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from rollshard.store.format.schema import Row, Status
from rollshard.store.io.writer import ShardWriter
from rollshard.train.advantages import grpo_advantages, token_advantages
from rollshard.train.config import LossConfig, TrainConfig
from rollshard.train.corrections import (
    cispo_loss,
    dppo_masks,
    geo_rs_keep,
    k3_rs_keep,
    m2po_keep,
    opsm_keep,
    sapo_gate,
    sapo_loss,
)
from rollshard.train.losses import LossNorm, policy_loss
from tests.train.test_config import parse

L = math.log


def cfg(**kw) -> LossConfig:
    return LossConfig(**kw)


def t(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def run(logp, rollout, adv, mask, cu, config, *, prox=None, **kw):
    """Loss, d loss / d logp and metrics of policy_loss at the given logprobs (``prox``: decoupled mode's)."""
    lp = t(logp).requires_grad_(True)
    loss, metrics = policy_loss(
        lp,
        rollout_logp=t(rollout),
        advantages=t(adv),
        loss_mask=t(mask),
        cu_seqlens=torch.tensor(cu),
        config=config,
        prox_logp=None if prox is None else t(prox),
        **kw,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, metrics


def at_ratio_one(**kw) -> LossConfig:
    """Decoupled mode with no importance weight: with logp == prox the ratio is 1 and PPO's per-token loss is -A,
    while M2PO, Geo-RS and K3-RS read pi_prox / mu and OPSM reads pi_theta / mu."""
    return cfg(mode="decoupled", is_correction="none", **kw)


# -- CISPO ---------------------------------------------------------------------------------------------------------


def test_cispo_value_and_gradient_keep_the_clipped_tokens():
    # logp = -1 everywhere, mu = -1 - log r, so r = [0.5, 2, 6, 6], A = [1, 1, 1, -1]; CISPO's defaults (1, 4) clip
    # the weight to [0, 5]: w = [0.5, 2, 5, 5]. Per token -w A logp = w A: [0.5, 2, 5, -5], sum 2.5, token-mean
    # 0.625. d/dlogp = -w A / 4 = [-0.125, -0.5, -1.25, 1.25]: the clipped tokens (r = 6) keep a gradient of
    # weight 5, where PPO's clip would give them none.
    r = [0.5, 2.0, 6.0, 6.0]
    mu = [-1.0 - L(x) for x in r]
    loss, grad, m = run([-1.0] * 4, mu, [1.0, 1.0, 1.0, -1.0], [1.0] * 4, [0, 4], cfg(pg_loss="cispo"))
    assert loss.item() == pytest.approx(0.625, abs=1e-6)
    torch.testing.assert_close(grad, t([-0.125, -0.5, -1.25, 1.25]), atol=1e-6, rtol=0)
    assert m["clip/frac_high"].item() == pytest.approx(0.25)  # A > 0 and r = 6 > 5 (TRL's cispo_clip_ratio)
    assert m["clip/frac_low"].item() == 0.0  # the lower bound 0 binds no ratio
    assert "sapo/soft_gate_mean" not in m and not any(k.startswith("mask/") for k in m)


def test_cispo_with_both_eps_set():
    # eps (0.2, 0.28): r = [0.5, 1.5] -> w = [0.8, 1.28]; A = [-1, 1]; logp = -1: per token w A = [-0.8, 1.28],
    # mean 0.24; gradient -w A / 2 = [0.4, -0.64]. Both tokens clipped: frac_low (A < 0, r < 0.8) = frac_high = 1/2.
    loss, grad, m = run(
        [-1.0, -1.0], [-1.0 - L(0.5), -1.0 - L(1.5)], [-1.0, 1.0], [1.0, 1.0], [0, 2],
        cfg(pg_loss="cispo", eps_low=0.2, eps_high=0.28),
    )
    assert loss.item() == pytest.approx(0.24, abs=1e-6)
    torch.testing.assert_close(grad, t([0.4, -0.64]), atol=1e-6, rtol=0)
    assert m["clip/frac_low"].item() == 0.5 and m["clip/frac_high"].item() == 0.5


def test_cispo_weight_carries_no_gradient():
    # cispo_loss alone, with a ratio that has a graph: the weight is sg(clip(r)), so d/dr = 0 and
    # d/dlogp = -clip(r) A = [-1.5, 2.0] (r = [1.5, 2.0], A = [1, -1], logp = [-2, -3]; values -w A logp = [3, -6]).
    logp = t([-2.0, -3.0]).requires_grad_(True)
    ratio = t([1.5, 2.0]).requires_grad_(True)
    out = cispo_loss(logp, ratio, t([1.0, -1.0]), eps_low=1.0, eps_high=4.0)
    torch.testing.assert_close(out.detach(), t([3.0, -6.0]), atol=1e-6, rtol=0)
    g_logp, g_ratio = torch.autograd.grad(out.sum(), [logp, ratio], allow_unused=True)
    torch.testing.assert_close(g_logp, t([-1.5, 2.0]), atol=1e-6, rtol=0)
    assert g_ratio is None


# -- SAPO ----------------------------------------------------------------------------------------------------------


def test_sapo_gate_worked_values():
    # (4 / tau) sigmoid(tau (r - 1)), tau = 1 where A > 0 else 2 (A == 0 takes tau_neg):
    #   r=1,A=1: 4 * 0.5 = 2;  r=1,A=-1: 2 * 0.5 = 1;  r=2,A=1: 4 * sigmoid(1) = 4 * 0.7310586 = 2.9242343;
    #   r=2,A=-1: 2 * sigmoid(2) = 2 * 0.8807971 = 1.7615942;  r=0.5,A=0: 2 * sigmoid(-1) = 2 * 0.2689414 = 0.5378828
    gate = sapo_gate(t([1.0, 1.0, 2.0, 2.0, 0.5]), t([1.0, -1.0, 1.0, -1.0, 0.0]), tau_pos=1.0, tau_neg=2.0)
    torch.testing.assert_close(gate, t([2.0, 1.0, 2.9242343, 1.7615942, 0.5378828]), atol=1e-6, rtol=0)
    # sapo_loss: -gate A, the gate returned without a graph
    ratio = t([2.0, 2.0]).requires_grad_(True)
    loss, g = sapo_loss(ratio, t([1.0, -1.0]), tau_pos=1.0, tau_neg=2.0)
    torch.testing.assert_close(loss.detach(), t([-2.9242343, 1.7615942]), atol=1e-6, rtol=0)
    assert not g.requires_grad and loss.requires_grad


def test_sapo_gradient_at_ratio_one_is_the_plain_policy_gradient():
    # d/dlogp of -A (4 / tau) sigmoid(tau (r - 1)) = -A 4 s (1 - s) r = -A at r = 1 (s = 1/2), whatever tau.
    # Values (default tau 1 / 1.05): A=1: -2; A=-1: +2/1.05 = 1.9047619; A=0.5: -1 -> mean -0.3650794.
    loss, grad, m = run([-1.0] * 3, [-1.0] * 3, [1.0, -1.0, 0.5], [1.0] * 3, [0, 3], cfg(pg_loss="sapo"))
    assert loss.item() == pytest.approx((-2 + 2 / 1.05 - 1) / 3, abs=1e-6)
    torch.testing.assert_close(grad, t([-1.0, 1.0, -0.5]) / 3, atol=1e-6, rtol=0)
    # gates [2, 1.9047619, 2]: mean 1.9682540
    assert m["sapo/soft_gate_mean"].item() == pytest.approx((4 + 2 / 1.05) / 3, abs=1e-6)
    assert m["sapo/soft_gate_min"].item() == pytest.approx(2 / 1.05, abs=1e-6)
    assert m["sapo/soft_gate_max"].item() == pytest.approx(2.0, abs=1e-6)
    assert not any(k.startswith("clip/") for k in m)  # SAPO does not clip


def test_sapo_is_asymmetric_away_from_ratio_one():
    # r = 2, tau_pos 1, tau_neg 2: gradient -A 4 s (1 - s) r.
    #   A=+1: s = sigmoid(1) = 0.7310586, 4 s (1-s) 2 = 1.5728955 -> -1.5728955
    #   A=-1: s = sigmoid(2) = 0.8807971, 4 s (1-s) 2 = 0.8399487 -> +0.8399487 (the larger tau fades faster)
    # loss: (-2.9242343 + 1.7615942) / 2 = -0.5813201; gradients / 2.
    loss, grad, _ = run(
        [-1.0 + L(2.0)] * 2, [-1.0] * 2, [1.0, -1.0], [1.0, 1.0], [0, 2],
        cfg(pg_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=2.0),
    )
    assert loss.item() == pytest.approx(-0.5813201, abs=1e-6)
    torch.testing.assert_close(grad, t([-1.5728955, 0.8399487]) / 2, atol=1e-6, rtol=0)


# -- DPPO ----------------------------------------------------------------------------------------------------------


def test_dppo_mask_value_gradient_and_kl_on_masked_tokens():
    # p_mu = 0.5 everywhere; p_theta = [0.8, 0.6, 0.2, 0.4, 0.2, 0.8], A = [1, 1, -1, -1, 0, 0]; r = p / 0.5 =
    # [1.6, 1.2, 0.4, 0.8, 0.4, 1.6]. Masks (low = high = 0.2, strict): t0 A>0, diff 0.3 > 0.2 -> dropped (high);
    # t1 diff 0.1 kept; t2 A<0, diff -0.3 < -0.2 dropped (low); t3 -0.1 kept; t4 A == 0, diff -0.3: the low side,
    # dropped; t5 A == 0, diff +0.3: the high side is for A > 0 only, kept (its -A r is 0 anyway).
    # Policy part -keep A r: t1 -1.2, t3 +0.8 -> -0.4. KL part on every loss token, 0.1 (log r)^2:
    #   log^2 = [0.2209034, 0.0332412, 0.8395887, 0.0497930, 0.8395887, 0.2209034], sum 2.2040184 -> 0.2204018
    # token-mean (-0.4 + 0.2204018) / 6 = -0.0299330.
    # Gradient -keep A r + 0.2 log r: [0.0940007, -1.1635357, -0.1832581, 0.7553713, -0.1832581, 0.0940007] / 6.
    p = [0.8, 0.6, 0.2, 0.4, 0.2, 0.8]
    loss, grad, m = run(
        [L(x) for x in p], [L(0.5)] * 6, [1.0, 1.0, -1.0, -1.0, 0.0, 0.0], [1.0] * 6, [0, 6],
        cfg(pg_loss="dppo", dppo_kl_tau=0.1),
    )
    assert loss.item() == pytest.approx(-0.0299330, abs=1e-6)
    expected = t([0.0940007, -1.1635357, -0.1832581, 0.7553713, -0.1832581, 0.0940007]) / 6
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    assert m["mask/dppo_high"].item() == pytest.approx(1 / 6)
    assert m["mask/dppo_low"].item() == pytest.approx(2 / 6)
    assert m["mask/any"].item() == pytest.approx(3 / 6)
    assert not any(k.startswith("clip/") for k in m)  # DPPO does not clip


def test_dppo_kl_term_alone_when_every_token_is_masked():
    # Both tokens dropped (t0: A>0, p 0.8 vs 0.5; t1: A<0, p 0.2 vs 0.5): the loss is the KL term alone,
    # 0.1 (0.2209034 + 0.8395887) / 2 = 0.0530246, gradient 0.2 log r / 2 = [0.0470004, -0.0916291].
    args = ([L(0.8), L(0.2)], [L(0.5)] * 2, [1.0, -1.0], [1.0, 1.0], [0, 2])
    loss, grad, m = run(*args, cfg(pg_loss="dppo", dppo_kl_tau=0.1))
    assert m["mask/any"].item() == 1.0
    assert loss.item() == pytest.approx(0.0530246, abs=1e-6)
    torch.testing.assert_close(grad, t([0.0470004, -0.0916291]), atol=1e-6, rtol=0)
    # ... and with kl_tau 0 nothing is left: loss 0, gradient 0.
    loss, grad, _ = run(*args, cfg(pg_loss="dppo", dppo_kl_tau=0.0))
    assert loss.item() == 0.0 and grad.abs().max().item() == 0.0


def test_dppo_masks_compare_probabilities_strictly():
    # low = high = 0: p_theta == p_mu (diff exactly 0) is not dropped on either side (strict > and <); any
    # difference is. A == 0 is on the low side.
    logp = t([L(0.5), L(0.5), L(0.6), L(0.4), L(0.4), L(0.6)])
    adv = t([1.0, -1.0, 1.0, -1.0, 0.0, 0.0])
    high, low = dppo_masks(logp, rollout_logp=t([L(0.5)] * 6), advantages=adv, low=0.0, high=0.0)
    assert high.tolist() == [False, False, True, False, False, False]
    assert low.tolist() == [False, False, False, True, True, False]
    # Probabilities, not log-ratios: p 0.02 vs 0.01 is a log-ratio of 0.69 but a difference of 0.01 <= 0.2: kept.
    high, low = dppo_masks(t([L(0.02)]), rollout_logp=t([L(0.01)]), advantages=t([1.0]), low=0.2, high=0.2)
    assert not high.any() and not low.any()


# -- OPSM ----------------------------------------------------------------------------------------------------------

# Four sequences (rollshard's token advantages: 0 on mask-0 tokens), gap = log mu - log pi per token:
#   seq0 [prompt, A=-1 gap 0.3, A=-1 gap 0.1]: mean over loss tokens 0.2 > 0.15 -> dropped
#   seq1 [prompt with gap 5.0, A=-1 gap 0.1, A=-1 gap 0.1]: mean 0.1 (the prompt is not a loss token) -> kept
#   seq2 [A=+0.5 gap 0.5, A=+0.5 gap 0.5]: over delta but a positive advantage -> kept
#   seq3 [A=-1 gap 0.2]: a one-token sequence over delta -> dropped
OPSM_GAP = [0.0, 0.3, 0.1, 5.0, 0.1, 0.1, 0.5, 0.5, 0.2]
OPSM_ADV = [0.0, -1.0, -1.0, 0.0, -1.0, -1.0, 0.5, 0.5, -1.0]
OPSM_MASK = [0.0, 1, 1, 0, 1, 1, 1, 1, 1]
OPSM_CU = [0, 3, 6, 8, 9]
OPSM_KEEP = [True, False, False, True, True, True, True, True, False]


def test_opsm_keep_worked_example():
    rollout = t([-1.0] * 9)
    keep = opsm_keep(rollout - t(OPSM_GAP), rollout_logp=rollout, advantages=t(OPSM_ADV), mask=t(OPSM_MASK),
                     cu_seqlens=torch.tensor(OPSM_CU), delta=0.15)
    assert keep.tolist() == OPSM_KEEP
    # delta is strict: at pi == mu the gap is 0, and delta 0 drops nothing
    keep = opsm_keep(rollout, rollout_logp=rollout, advantages=t(OPSM_ADV), mask=t(OPSM_MASK),
                     cu_seqlens=torch.tensor(OPSM_CU), delta=0.0)
    assert keep.all()


def test_opsm_in_the_loss_keeps_the_normalizer_and_the_kept_gradients():
    # Ratio 1 (decoupled, logp == prox), PPO per token -A. Loss tokens: 7. Kept: seq1 (+1, +1) and seq2
    # (-0.5, -0.5) -> sum 1; token-mean over all 7 loss tokens, dropped ones included: 1/7 = 0.1428571
    # (over the 4 kept it would be 0.25). mask/opsm = 3/7 (seq0's two tokens and seq3's one).
    logp = [-1.0 - g for g in OPSM_GAP]
    loss, grad, m = run(logp, [-1.0] * 9, OPSM_ADV, OPSM_MASK, OPSM_CU, at_ratio_one(opsm_delta=0.15), prox=logp)
    assert loss.item() == pytest.approx(1 / 7, abs=1e-6)
    assert m["mask/opsm"].item() == pytest.approx(3 / 7) and m["mask/any"].item() == pytest.approx(3 / 7)
    assert m["tokens"].item() == 7
    # The mask only zeroes: each kept token's gradient is the one without OPSM (-A / 7), a dropped one's is 0.
    _, plain, _ = run(logp, [-1.0] * 9, OPSM_ADV, OPSM_MASK, OPSM_CU, at_ratio_one(), prox=logp)
    torch.testing.assert_close(grad, torch.where(torch.tensor(OPSM_KEEP), plain, torch.zeros(9)), atol=0, rtol=0)
    torch.testing.assert_close(grad, t([0, 0, 0, 0, 1, 1, -0.5, -0.5, 0]) / 7, atol=1e-6, rtol=0)


def test_opsm_on_one_member_groups_whose_advantage_is_the_reward():
    # rollshard's advantages: a one-row group's advantage is its reward (mean 0, std 1, / (1 + 1e-6)):
    # rewards -0.5 and +0.5 alone -> -0.4999995, +0.4999995; the group [1, 0] -> +-0.5 / (0.7071068 + 1e-6)
    # = +-0.7071058. Every sequence (2 loss tokens) at gap 0.2 > delta 0.1: OPSM drops the negative ones, the
    # one-row group of reward -0.5 among them. Kept -A at ratio 1: -(0.4999995 + 0.7071058) * 2 / 8 = -0.3017763.
    adv = grpo_advantages(t([-0.5, 0.5, 1.0, 0.0]), torch.tensor([0, 1, 2, 2])).advantages
    torch.testing.assert_close(adv, t([-0.4999995, 0.4999995, 0.7071058, -0.7071058]), atol=1e-6, rtol=0)
    cu = torch.tensor([0, 2, 4, 6, 8])
    adv_t = token_advantages(adv, cu, torch.ones(8))
    logp = [-1.2] * 8  # mu = -1: gap 0.2
    loss, _, m = run(logp, [-1.0] * 8, adv_t.tolist(), [1.0] * 8, cu.tolist(), at_ratio_one(opsm_delta=0.1), prox=logp)
    assert m["mask/opsm"].item() == 0.5
    assert loss.item() == pytest.approx(-0.3017763, abs=1e-6)


# -- M2PO ----------------------------------------------------------------------------------------------------------


def test_m2po_drops_the_largest_until_the_rest_is_below_tau():
    # log_w = [0.1, -0.5, 0.0, 0.3, (masked) 2.0]: squares of the loss tokens, largest first [0.25, 0.09, 0.01, 0]
    # (the sign does not matter; the masked 4.0 is not counted). Mean of the rest after dropping k:
    # k=0 0.0875, k=1 0.0333333, k=2 0.005, k=3 0.
    lw, mask = t([0.1, -0.5, 0.0, 0.3, 2.0]), t([1.0, 1, 1, 1, 0])
    assert m2po_keep(lw, mask, tau=0.04).tolist() == [True, False, True, True, True]  # k=1
    assert m2po_keep(lw, mask, tau=0.03).tolist() == [True, False, True, False, True]  # k=2
    assert m2po_keep(lw, mask, tau=0.09).tolist() == [True] * 5  # k=0: 0.0875 < 0.09
    # "below" is strict: [0.5, 0, 0, 0] has mean 0.25 / 4 = 0.0625 exactly; tau 0.0625 drops the 0.5 token.
    assert m2po_keep(t([0.5, 0.0, 0.0, 0.0]), torch.ones(4), tau=0.0625).tolist() == [False, True, True, True]
    assert m2po_keep(t([0.5, 0.0, 0.0, 0.0]), torch.ones(4), tau=0.07).all()


def test_m2po_keeps_the_smallest_when_no_suffix_qualifies():
    # squares [0.25, 0.25, 0.16]: suffix means 0.22, 0.205, 0.16, none < 0.1 -> only the smallest (0.4) stays.
    assert m2po_keep(t([0.5, -0.5, 0.4]), torch.ones(3), tau=0.1).tolist() == [False, False, True]
    # One token, however far: kept. No loss token: nothing to drop.
    assert m2po_keep(t([10.0]), torch.ones(1), tau=1e-6).tolist() == [True]
    assert m2po_keep(t([10.0, 10.0]), torch.zeros(2), tau=1e-6).all()


def test_m2po_reads_the_proximal_policy_in_decoupled_mode():
    # pi_theta is far from mu (log 2 on every token) but pi_prox == mu: log_w = 0, nothing dropped; the loss is
    # PPO at ratio pi / pi_prox = 2, clipped at 1.28 for A = 1: -1.28. With pi_prox at log_w [0.5, 0, 0, 0] and
    # tau 0.0625 (see above) the first token goes: -1.28 * 3 / 4 = -0.96, mask/m2po 1/4.
    mu = [-1.0] * 4
    logp = [-1.0 + L(2.0)] * 4
    config = at_ratio_one(m2po_tau=0.0625)
    loss, _, m = run(logp, mu, [1.0] * 4, [1.0] * 4, [0, 4], config, prox=mu)
    assert m["mask/m2po"].item() == 0.0 and loss.item() == pytest.approx(-1.28, abs=1e-6)
    prox = [-0.5, -1.0, -1.0, -1.0]
    loss, _, m = run(logp, mu, [1.0] * 4, [1.0] * 4, [0, 4], config, prox=prox)
    assert m["mask/m2po"].item() == 0.25 and loss.item() == pytest.approx(-0.96, abs=1e-6)
    # In bypass mode pi_theta stands in for pi_prox: log_w = log 2 on all four, squares 0.480453 each, none
    # below 0.0625 -> three dropped, one kept: loss -1.28 / 4 = -0.32 (PPO clips r = 2 at 1.28).
    loss, _, m = run(logp, mu, [1.0] * 4, [1.0] * 4, [0, 4], cfg(m2po_tau=0.0625))
    assert m["mask/m2po"].item() == 0.75 and loss.item() == pytest.approx(-0.32, abs=1e-6)


def test_m2po_pools_each_micro_batch_on_its_own():
    # Two sequences of two tokens, log pi_prox - log mu = [0.3, 0.1 | 0.0, 0.0], A = 1, ratio 1, tau 0.04.
    # One batch: squares [0.09, 0.01, 0, 0], mean 0.025 < 0.04 -> nothing dropped; loss -4/4 = -1.
    # Split into one micro-batch per sequence (global normalizer 4 tokens): the first pools [0.09, 0.01] alone,
    # mean 0.05 >= 0.04 -> drops the 0.3 token (loss -1/4); the second drops nothing (-2/4): sum -0.75, not -1.
    # AReaL pools a micro-batch too (module docstring): the split changes M2PO's decision, by design.
    mu = torch.full((4,), -1.0)
    prox = mu + t([0.3, 0.1, 0.0, 0.0])
    config = at_ratio_one(m2po_tau=0.04)
    whole, _, m = run(prox.tolist(), mu.tolist(), [1.0] * 4, [1.0] * 4, [0, 2, 4], config, prox=prox.tolist())
    assert whole.item() == pytest.approx(-1.0, abs=1e-6) and m["mask/m2po"].item() == 0.0
    norm = LossNorm(tokens=4.0, sequences=2.0, norm_len=2.0)
    parts = [
        run(prox[s].tolist(), mu[s].tolist(), [1.0] * 2, [1.0] * 2, [0, 2], config, prox=prox[s].tolist(), norm=norm)
        for s in (slice(0, 2), slice(2, 4))
    ]
    assert [p[0].item() for p in parts] == pytest.approx([-0.25, -0.5], abs=1e-6)
    assert [p[2]["mask/m2po"].item() for p in parts] == [0.5, 0.0]
    assert parts[0][1].tolist() == pytest.approx([0.0, -0.25], abs=1e-6)  # the dropped token has no gradient


# -- Geo-RS --------------------------------------------------------------------------------------------------------


def test_geo_rs_keeps_sequences_whose_geometric_mean_ratio_is_in_bounds():
    # Bounds [0.999, 1.001] on exp(mean log_w) over a sequence's loss tokens:
    #   seq0 [log 2, log 0.5]: geometric mean 1 -> kept (each token alone would be far out)
    #   seq1 [log 1.5, log 1.5]: 1.5 -> dropped
    #   seq2 [log 0.999] and seq3 [log 1.001]: one-token sequences on the bounds -> kept (inclusive)
    #   seq4 [log 1.002]: just over -> dropped;  seq5 [log 0.998]: just under -> dropped
    #   seq6 [(masked) log 100, 0]: the masked token does not count -> 1, kept
    lw = t([L(2.0), L(0.5), L(1.5), L(1.5), L(0.999), L(1.001), L(1.002), L(0.998), L(100.0), 0.0])
    mask = t([1.0] * 8 + [0.0, 1.0])
    cu = torch.tensor([0, 2, 4, 5, 6, 7, 8, 10])
    keep = geo_rs_keep(lw, mask, cu, low=0.999, high=1.001)
    assert keep.tolist() == [True, True, False, False, True, True, False, False, True, True]
    # lo = hi = 1 keeps exactly the sequences at ratio 1: seq0 (mean exactly 0) and seq6.
    keep = geo_rs_keep(lw, mask, cu, low=1.0, high=1.0)
    assert keep.tolist() == [True, True, False, False, False, False, False, False, True, True]


def test_geo_rs_ratio_is_pi_prox_over_mu():
    # Bounds [0.5, 1]: pi_prox / mu = 2 (seq0) is out, 0.6 (seq1) is in. The other orientation, mu / pi_prox,
    # would give 0.5 (in) and 1.667 (out). Ratio-1 PPO, A = 1: kept seq1's two tokens -> -2/4 = -0.5.
    mu = [-1.0] * 4
    prox = [-1.0 + L(2.0)] * 2 + [-1.0 + L(0.6)] * 2
    loss, grad, m = run(prox, mu, [1.0] * 4, [1.0] * 4, [0, 2, 4], at_ratio_one(geo_rs=(0.5, 1.0)), prox=prox)
    assert m["mask/geo_rs"].item() == 0.5
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)
    torch.testing.assert_close(grad, t([0.0, 0.0, -0.25, -0.25]), atol=1e-6, rtol=0)


# -- K3-RS ---------------------------------------------------------------------------------------------------------


def test_k3_rs_mean_versus_sum():
    # k3 = rho - 1 - log rho: rho 2 -> 1 - 0.6931472 = 0.3068528; rho 0.5 -> -0.5 + 0.6931472 = 0.1931472; rho 1 -> 0.
    #   seq0 [rho 2, rho 1]: mean 0.1534264, sum 0.3068528
    #   seq1 [rho 0.5] (one token): 0.1931472 either way
    #   seq2 [rho 1, (masked) rho 100]: 0 (the masked token does not count, in the sum either)
    lw = t([L(2.0), 0.0, L(0.5), 0.0, L(100.0)])
    mask = t([1.0, 1, 1, 1, 0])
    cu = torch.tensor([0, 2, 3, 5])
    assert k3_rs_keep(lw, mask, cu, threshold=0.2, reduce="mean").tolist() == [True] * 5
    assert k3_rs_keep(lw, mask, cu, threshold=0.2, reduce="sum").tolist() == [False, False, True, True, True]
    assert k3_rs_keep(lw, mask, cu, threshold=0.18, reduce="mean").tolist() == [True, True, False, True, True]
    # "at most": threshold 0 keeps the sequence whose statistic is exactly 0.
    assert k3_rs_keep(lw, mask, cu, threshold=0.0, reduce="sum").tolist() == [False, False, False, True, True]
    with pytest.raises(ValueError, match="mean or sum"):
        k3_rs_keep(lw, mask, cu, threshold=0.2, reduce="max")


def test_k3_rs_in_the_loss():
    # The sequences above at ratio 1 (decoupled, pi_prox / mu = rho), A = 1 on every loss token, threshold 0.2:
    # mean keeps all 4 loss tokens (loss -1); sum drops seq0 (2 tokens): -2/4 = -0.5, mask/k3_rs 0.5.
    mu = [-1.0] * 5
    prox = [-1.0 + x for x in (L(2.0), 0.0, L(0.5), 0.0, L(100.0))]
    args = (prox, mu, [1.0, 1, 1, 1, 0], [1.0, 1, 1, 1, 0], [0, 2, 3, 5])
    loss, _, m = run(*args, at_ratio_one(k3_rs=0.2), prox=prox)
    assert loss.item() == pytest.approx(-1.0, abs=1e-6) and m["mask/k3_rs"].item() == 0.0
    loss, _, m = run(*args, at_ratio_one(k3_rs=0.2, k3_rs_reduce="sum"), prox=prox)
    assert loss.item() == pytest.approx(-0.5, abs=1e-6) and m["mask/k3_rs"].item() == 0.5


# -- edges ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pg_loss", ["ppo", "cispo", "sapo", "dppo"])
def test_every_token_dropped_gives_zero_loss_zero_gradient_finite_metrics(pg_loss):
    # Bypass, every token at ratio 2, Geo-RS [0.999, 1.001]: both sequences (one of them a single token) dropped.
    extra = {"dppo_kl_tau": 0.0} if pg_loss == "dppo" else {}  # DPPO's KL term stays on dropped tokens (above)
    loss, grad, m = run(
        [-1.0 + L(2.0)] * 3, [-1.0] * 3, [1.0, 1.0, -1.0], [1.0] * 3, [0, 2, 3],
        cfg(pg_loss=pg_loss, geo_rs=(0.999, 1.001), **extra),
    )
    assert loss.item() == 0.0 and grad.abs().max().item() == 0.0
    assert m["mask/geo_rs"].item() == 1.0 and m["mask/any"].item() == 1.0
    assert all(math.isfinite(v.item()) for v in m.values())


def test_no_loss_token_at_all():
    # Every correction on, loss mask all 0: loss 0, gradient 0, no mask/* figure (no valid token to share).
    config = cfg(pg_loss="dppo", opsm_delta=0.0, m2po_tau=0.04, geo_rs=(0.999, 1.001), k3_rs=0.0)
    loss, grad, m = run([-3.0, -2.0, -1.0], [-1.0] * 3, [-1.0] * 3, [0.0] * 3, [0, 1, 3], config)
    assert loss.item() == 0.0 and grad.abs().max().item() == 0.0
    assert m["tokens"].item() == 0 and not any(k.startswith("mask/") for k in m)
    assert all(math.isfinite(v.item()) for v in m.values())
    loss, grad, m = run([-3.0, -2.0], [-1.0] * 2, [1.0, 1.0], [0.0] * 2, [0, 2], cfg(pg_loss="sapo"))
    assert loss.item() == 0.0 and "sapo/soft_gate_mean" not in m


def test_masks_combine_and_any_counts_each_dropped_token_once():
    # Three one-token sequences. OPSM drops seq0 (A<0, gap 0.2 > 0.1); Geo-RS [0.9, 1.1] drops seq0
    # (pi/mu = e^-0.2 = 0.8187) and seq1 (e^0.2 = 1.2214); seq2 (ratio 1) stays. mask/opsm 1/3, mask/geo_rs 2/3,
    # mask/any 2/3 (not 1). Ratio-1 PPO: only seq2 (A = 1): -1/3.
    logp = [-1.2, -0.8, -1.0]
    loss, _, m = run(logp, [-1.0] * 3, [-1.0, 1.0, 1.0], [1.0] * 3, [0, 1, 2, 3],
                     at_ratio_one(opsm_delta=0.1, geo_rs=(0.9, 1.1)), prox=logp)
    assert m["mask/opsm"].item() == pytest.approx(1 / 3) and m["mask/geo_rs"].item() == pytest.approx(2 / 3)
    assert m["mask/any"].item() == pytest.approx(2 / 3)
    assert loss.item() == pytest.approx(-1 / 3, abs=1e-6)


# -- micro-batch invariance ----------------------------------------------------------------------------------------

SPLIT_LENGTHS = [5, 2, 7, 4, 3, 6, 1, 4]  # eight sequences (one of a single token), two micro-batches of four


def _split(config: LossConfig):
    """policy_loss over one batch vs summed over two micro-batches (whole sequences) with the global normalizer."""
    g = torch.Generator().manual_seed(3)
    T = sum(SPLIT_LENGTHS)
    cu = torch.tensor([0, *torch.tensor(SPLIT_LENGTHS).cumsum(0).tolist()])
    rollout = -torch.rand(T, generator=g) * 3
    logp = (rollout + torch.randn(T, generator=g) * 0.3).requires_grad_(True)
    seq_adv = torch.tensor([1.0, -1.0, -0.5, 0.8, -1.2, 0.3, -0.7, 1.1])
    mask = (torch.rand(T, generator=g) > 0.2).float()
    adv = token_advantages(seq_adv, cu, mask)
    whole, m = policy_loss(logp, rollout_logp=rollout, advantages=adv, loss_mask=mask, cu_seqlens=cu, config=config)
    (g_whole,) = torch.autograd.grad(whole, logp)
    cut = int(cu[4])
    parts = [(slice(0, cut), cu[:5]), (slice(cut, T), cu[4:] - cut)]
    norm = LossNorm.combine([LossNorm.of(mask[s], c) for s, c in parts])
    total, g_sum = 0.0, torch.zeros(T)
    for s, c in parts:
        lp = logp.detach()[s].clone().requires_grad_(True)
        loss, _ = policy_loss(
            lp, rollout_logp=rollout[s], advantages=adv[s], loss_mask=mask[s], cu_seqlens=c, config=config, norm=norm
        )
        (g_sum[s],) = torch.autograd.grad(loss, lp)
        total += loss.item()
    return whole.item(), total, g_whole, g_sum, m


@pytest.mark.parametrize(
    "config,name",
    [
        (cfg(opsm_delta=0.0), "opsm"),
        (cfg(geo_rs=(0.9, 1.1)), "geo_rs"),
        (cfg(k3_rs=0.03), "k3_rs"),
        (cfg(k3_rs=0.1, k3_rs_reduce="sum"), "k3_rs"),
        (cfg(pg_loss="dppo", dppo_mask_low=0.05, dppo_mask_high=0.05), "dppo_low"),
        (cfg(pg_loss="cispo", eps_high=0.2, opsm_delta=0.0, geo_rs=(0.9, 1.1), k3_rs=0.03), "any"),
        (cfg(pg_loss="sapo", geo_rs=(0.9, 1.1), agg="seq-mean-token-mean"), "geo_rs"),
    ],
)
def test_sequence_masks_split_into_micro_batches_equal_one_batch(config, name):
    whole, total, g_whole, g_sum, m = _split(config)
    assert 0.0 < m[f"mask/{name}"].item() < 1.0  # the mask drops some tokens and keeps others here
    assert total == pytest.approx(whole, abs=1e-6)
    torch.testing.assert_close(g_sum, g_whole, atol=1e-7, rtol=1e-6)
    assert g_whole.abs().sum() > 0


# -- configuration -------------------------------------------------------------------------------------------------


def test_correction_defaults():
    c = LossConfig()
    assert (c.pg_loss, c.sapo_tau_pos, c.sapo_tau_neg) == ("ppo", 1.0, 1.05)
    assert (c.dppo_mask_low, c.dppo_mask_high, c.dppo_kl_tau) == (0.2, 0.2, 1e-3)
    assert (c.opsm_delta, c.m2po_tau, c.geo_rs, c.k3_rs, c.k3_rs_reduce) == (None, None, None, None, "mean")
    assert LossConfig(pg_loss="cispo").clip_range() == (1.0, 4.0)
    assert LossConfig(pg_loss="cispo", ratio_level="sequence").clip_range() == (1.0, 4.0)  # whatever the level
    assert LossConfig(pg_loss="sapo").clip_range() == (0.2, 0.28)


def test_correction_flags_parse():
    c = parse(
        "--pg-loss", "dppo", "--sapo-tau-pos", "2", "--sapo-tau-neg", "3.5", "--dppo-mask-low", "0.1",
        "--dppo-mask-high", "0.3", "--dppo-kl-tau", "0.01", "--opsm-delta", "1e-4", "--m2po-tau", "0.04",
        "--geo-rs", "0.999,1.001", "--k3-rs", "0.01", "--k3-rs-reduce", "sum",
    ).loss
    assert (c.pg_loss, c.sapo_tau_pos, c.sapo_tau_neg) == ("dppo", 2.0, 3.5)
    assert (c.dppo_mask_low, c.dppo_mask_high, c.dppo_kl_tau) == (0.1, 0.3, 0.01)
    assert (c.opsm_delta, c.m2po_tau, c.geo_rs, c.k3_rs, c.k3_rs_reduce) == (1e-4, 0.04, (0.999, 1.001), 0.01, "sum")
    off = parse("--opsm-delta", "none", "--m2po-tau", "none", "--geo-rs", "none", "--k3-rs", "none").loss
    assert (off.opsm_delta, off.m2po_tau, off.geo_rs, off.k3_rs) == (None, None, None, None)


def test_cispo_eps_resolve_into_the_written_config(tmp_path, capsys):
    from rollshard.train.cli import main

    c = parse("--pg-loss", "cispo").loss
    assert (c.eps_low, c.eps_high) == (1.0, 4.0)
    assert parse("--pg-loss", "cispo", "--eps-high", "2").loss.eps_high == 2.0
    assert (parse("--pg-loss", "sapo").loss.eps_low, parse("--pg-loss", "sapo").loss.eps_high) == (0.2, 0.28)
    assert main(["--pg-loss", "cispo", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["loss"]
    assert (printed["pg_loss"], printed["eps_low"], printed["eps_high"]) == ("cispo", 1.0, 4.0)


def test_correction_keys_from_yaml_and_flags_over_them(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "loss:\n  pg_loss: sapo\n  sapo_tau_pos: 0.5\n  sapo_tau_neg: 0.7\n  dppo_mask_low: 0.15\n"
        "  dppo_mask_high: 0.25\n  dppo_kl_tau: 0.002\n  opsm_delta: 0.001\n  m2po_tau: 0.05\n"
        "  geo_rs: [0.99, 1.01]\n  k3_rs: 0.02\n  k3_rs_reduce: sum\n"
    )
    c = parse("--config", str(f))
    assert (c.loss.pg_loss, c.loss.sapo_tau_pos, c.loss.sapo_tau_neg) == ("sapo", 0.5, 0.7)
    assert (c.loss.dppo_mask_low, c.loss.dppo_mask_high, c.loss.dppo_kl_tau) == (0.15, 0.25, 0.002)
    assert (c.loss.opsm_delta, c.loss.m2po_tau, c.loss.geo_rs) == (0.001, 0.05, (0.99, 1.01))
    assert (c.loss.k3_rs, c.loss.k3_rs_reduce) == (0.02, "sum")
    over = parse("--config", str(f), "--pg-loss", "cispo", "--geo-rs", "0.9,1.2", "--m2po-tau", "none")
    assert (over.loss.pg_loss, over.loss.geo_rs, over.loss.m2po_tau) == ("cispo", (0.9, 1.2), None)
    assert (over.loss.eps_low, over.loss.eps_high) == (1.0, 4.0)  # resolved for the surrogate of the flag
    back = tmp_path / "back.yaml"
    back.write_text(c.to_yaml())
    assert TrainConfig.from_yaml(back) == c


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--geo-rs", "1.1,1.2"], "--geo-rs"),
        (["--geo-rs", "0.9,0.95"], "--geo-rs"),
        (["--geo-rs", "0,1.1"], "--geo-rs"),
        (["--geo-rs", "0.9"], "--geo-rs"),
        (["--geo-rs", "0.9,1.1,1.2"], "--geo-rs"),
        (["--m2po-tau", "0"], "--m2po-tau"),
        (["--m2po-tau", "-0.1"], "--m2po-tau"),
        (["--sapo-tau-pos", "0"], "--sapo-tau-pos"),
        (["--sapo-tau-neg", "-1"], "--sapo-tau-neg"),
        (["--dppo-mask-low", "-0.1"], "--dppo-mask-low"),
        (["--dppo-mask-high", "-0.1"], "--dppo-mask-high"),
        (["--dppo-kl-tau", "-1"], "--dppo-kl-tau"),
        (["--opsm-delta", "-0.0001"], "--opsm-delta"),
        (["--k3-rs", "-0.01"], "--k3-rs"),
        (["--pg-loss", "grpo"], "--pg-loss: 'grpo' is not one of ppo, cispo"),  # a Literal's: the flag, the choices
        (["--k3-rs-reduce", "max"], "--k3-rs-reduce: 'max' is not one of"),
        (["--pg-loss", "cispo", "--eps-low", "1.5"], "--eps-low"),
    ],
)
def test_invalid_correction_values_are_one_line_errors_naming_the_flag(argv, message, capsys):
    from rollshard.train.cli import main

    with pytest.raises(ValueError, match=message):
        parse(*argv)
    assert main(["--data", "d", "--model", "m", "--out", "o", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rollshard-train: error:") and message in err and "\n" not in err


# A NaN is refused wherever it sits: min(a, b) > 0 would pass one that is not min's first argument (a NaN loss,
# the high TV mask silently off, the KL term silently off); an infinite temperature gives inf * 0 at r = 1.
@pytest.mark.parametrize("flag", ["--sapo-tau-pos", "--sapo-tau-neg", "--dppo-mask-low", "--dppo-mask-high",
                                  "--dppo-kl-tau"])
def test_nan_correction_values_are_refused(flag):
    with pytest.raises(ValueError, match=flag):
        parse(flag, "nan")


# -- end to end ----------------------------------------------------------------------------------------------------


def write_groups(out: Path, groups: list[tuple[list[float], float]], model: Path, *, n: int = 4) -> Path:
    """One group per entry ``(rewards, rollout logprob of every token)``, ``n`` response tokens per row."""
    from tests.train.conftest import generation_config

    with ShardWriter(out, writer_id="test", config=generation_config(model)) as w:
        for g, (rewards, mu) in enumerate(groups):
            w.write_group([
                Row(
                    sample_id=f"p{g}-{i}", prompt_id=f"p{g}", group_id=f"p{g}/policy/0", agent="policy", round=0,
                    prompt_tokens=[5 + g, 6, 7], response_tokens=[(11 * i + k + g) % 1000 + 3 for k in range(n)],
                    rollout_logprobs=[mu] * n, loss_mask=[1] * n, reward=r, status=Status.COMPLETED,
                    finish_reason="stop", weight_version="0", temperature=1.0, top_p=1.0, top_k=-1,
                )
                for i, r in enumerate(rewards)
            ])
    return out


def test_rollshard_train_step_logs_the_mask_shares(tiny_gpt2, tmp_path):
    from rollshard.train.checkpoint import CONFIG_FILE, latest_checkpoint
    from rollshard.train.cli import main
    from rollshard.train.metrics import read_metrics

    # The random tiny model gives its tokens log pi near -log(1024) = -6.9. Two groups of rewards [1, 0]
    # (advantages +-0.7071), 4 loss tokens a row, 16 in the step:
    #   group 0 stored at log mu = -1: pi / mu ~ e^-6, inside Geo-RS [1e-6, 1]; log mu - log pi ~ 6 > 1, so OPSM
    #     drops its negative row (4 tokens);
    #   group 1 stored at log mu = -50: pi / mu ~ e^43 > 1, Geo-RS drops both rows (8 tokens); OPSM's gap is
    #     negative.
    # mask/opsm = 4/16, mask/geo_rs = 8/16, mask/any = 12/16: the one row trained is group 0's positive one.
    data = write_groups(tmp_path / "data", [([1.0, 0.0], -1.0), ([1.0, 0.0], -50.0)], tiny_gpt2)
    out = tmp_path / "run"
    argv = [
        "--data", str(data), "--model", str(tiny_gpt2), "--out", str(out), "--groups-per-step", "2",
        "--micro-batch-tokens", "128", "--max-steps", "1", "--no-shuffle", "--no-progress", "--no-tensorboard",
        "--pg-loss", "cispo", "--opsm-delta", "1.0", "--geo-rs", "1e-6,1.0",
    ]
    assert main(argv) == 0
    (record,) = read_metrics(out)
    assert record["data/loss_tokens"] == 16
    assert record["mask/opsm"] == pytest.approx(0.25, abs=1e-6)
    assert record["mask/geo_rs"] == pytest.approx(0.5, abs=1e-6)
    assert record["mask/any"] == pytest.approx(0.75, abs=1e-6)
    # CISPO's lower bound 0 never binds; its upper bound 5 counts group 1's positive row (r at the clamp e^20;
    # dropped by Geo-RS, counted all the same), not group 0's (r ~ e^-6): 4/16.
    assert record["clip/frac_low"] == 0.0
    assert record["clip/frac_high"] == pytest.approx(0.25, abs=1e-6)
    assert record["optim/grad_norm"] > 0  # the kept row trains
    saved = yaml.safe_load((latest_checkpoint(out).path / CONFIG_FILE).read_text())["loss"]
    assert (saved["pg_loss"], saved["eps_low"], saved["eps_high"]) == ("cispo", 1.0, 4.0)
    assert (saved["opsm_delta"], saved["geo_rs"]) == (1.0, [1e-6, 1.0])


# -- the audit's counterfactual --------------------------------------------------------------------------------------


def test_counterfactual_worked_example():
    """rollshard.train.corrections.counterfactual, the audit's table, on six tokens of two sequences.

    mu = 0.1 everywhere; pi / mu = r = [6, 1.5, 0.4 | 0.5, 1, 100], A = [1, 1, 1 | -1, -1, 0], the last token off
    the loss mask (counted by nothing, and out of every per-sequence figure).
    - ppo clip 0.2 / 0.28: t0 (A > 0, 6 > 1.28), t1 (1.5 > 1.28), t3 (A < 0, 0.5 < 0.8)
    - dual clip 3: A < 0 and r > 3: none; cispo cap 5: t0; tis C 2: t0
    - sapo: 4 s (1 - s) with s = sigmoid(tau (r - 1)): t0 0.0266 < 0.5; t1 0.940, t2 0.915, t3 0.934, t4 1
    - dppo 0.2: p - p_mu = [0.5, 0.05, -0.06, -0.05, 0]: t0 only (A > 0, 0.5 > 0.2)
    - icepop [0.5, 5]: t0 (6 > 5), t2 (0.4 < 0.5); t3 sits on the bound 0.5 and stays
    - sequence mask 3: products 6 x 1.5 x 0.4 = 3.6 (over) and 0.5: t0-t2
    - opsm 1e-4: sequence 1 has A < 0 and mean log(mu / pi) = log(2) / 2 = 0.347 > 1e-4: t3, t4
    - m2po 0.04: (log r)^2 = [3.210, 0.164, 0.840, 0.480, 0]; suffix means of the sorted values 0.939, 0.371, 0.215,
      0.082, 0: the first below 0.04 is the last, so every token but t4 is dropped
    - geo-rs [0.7, 1.25]: geometric means 3.6^(1/3) = 1.533 (out) and 0.5^(1/2) = 0.707 (in): t0-t2
    - k3-rs mean 0.1: r - 1 - log r = [3.208, 0.0945, 0.316 | 0.193, 0]: means 1.206 (out), 0.0966 (in): t0-t2
    """
    from rollshard.train.corrections import counterfactual
    from rollshard.train.losses import LOG_RATIO_CLAMP

    r = t([6.0, 1.5, 0.4, 0.5, 1.0, 100.0])
    mu = torch.full((6,), math.log(0.1))
    config = LossConfig(geo_rs=(0.7, 1.25), k3_rs=0.1)
    out = counterfactual(mu + torch.log(r), rollout_logp=mu, advantages=t([1.0, 1.0, 1.0, -1.0, -1.0, 0.0]),
                         mask=t([1.0, 1, 1, 1, 1, 0]), cu_seqlens=torch.tensor([0, 3, 6]), config=config,
                         log_ratio_clamp=LOG_RATIO_CLAMP)
    hit = {name: torch.nonzero(h).flatten().tolist() for name, (_, h) in out.items()}
    assert hit == {
        "ppo clip": [0, 1, 3], "dual clip": [], "cispo": [0], "sapo": [0], "dppo": [0], "tis": [0],
        "icepop": [0, 2], "sequence mask": [0, 1, 2], "opsm": [3, 4], "m2po": [0, 1, 2, 3],
        "geo-rs": [0, 1, 2], "k3-rs": [0, 1, 2],
    }
    words = {name: w for name, (w, _) in out.items()}
    assert words["opsm"] == "delta 0.0001" and words["geo-rs"] == "[0.7, 1.25]" and words["k3-rs"] == "mean 0.1"

"""rollshard's off-policy corrections (train/corrections.py, applied by train/losses.py ``policy_loss``) against the
peers' own code, transcribed in tests/train/peers: the same seeded inputs through both, in each peer's layout.

Every test checks what both sides expose: the per-token loss (rollshard's ``surrogate``), the keep-masks
(``rollshard.train.corrections``), the aggregated loss, its gradient w.r.t. ``logp`` and the metrics that have a
counterpart. Where a peer normalizes differently from rollshard (a mask that shrinks the peer's normalizer, a
reduction the peer forces) the comment at the comparison says how the two are related.

The inputs (:func:`make_batch`): ten sequences of uneven lengths (one of a single token) packed end to end,
loss masks with holes, GRPO advantages (one per sequence, alternating sign), and three policies over the same
tokens: mu (``rollout``, the engine's logprobs), pi_prox (``prox``) and pi_theta (``logp``), each sequence of
pi_prox and pi_theta moved off mu by its own amount, from nearly on-policy to far off it. Each test asserts that
its clip or mask fires on some tokens and spares others (:func:`fires`), so that agreement is not agreement on a
no-op. All inputs are float64; the advantages are exact in float32, which ``policy_loss`` casts them to.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from rollshard.train import corrections
from rollshard.train.config import LossConfig
from rollshard.train.losses import policy_loss, surrogate
from rollshard.train.segments import segment_mean, segment_sum, sequence_ids
from tests.train.peers import areal, prime_rl, slime, trl, verl

SEEDS = (6, 49, 50, 89, 97)  # of seeds 0-149, those where every correction below fires (see fires())
LENGTHS = (6, 1, 9, 4, 12, 3, 7, 5, 8, 2)  # the second sequence has one token
DRIFTS = torch.tensor([0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0, 1.5, 2.5, 4.0], dtype=torch.float64)  # one per sequence

# Both sides compute in float64 and differ only in the order of their sums (packed index_add against padded rows,
# per-sample lists): far below 1e-10 of values of order 1.
F64 = dict(rtol=1e-10, atol=1e-12)
# rollshard's fractions (mask/*, clip/*, is/frac_dropped) are means of float32 0/1 values: an exact count over N,
# rounded once to float32 (relative 6e-8).
FRACTION = dict(rtol=0.0, atol=1e-7)
# verl's masked_mean divides by ``count + 1e-8`` (torch_functional.py L287-301): a relative 1e-8 / count on each
# per-sequence mean it takes (SAPO's forced seq-mean-token-mean, the RS statistics and masked fractions).
VERL = dict(rtol=1e-7, atol=3e-7)
# rollshard picks SAPO's temperature with torch.where(A > 0, tau_pos, tau_neg) on python floats, which makes a
# float32 tensor: tau_neg 1.05 becomes 1.0499999523 (relative 4.5e-8), and its 4 / tau is taken in float32 too.
# AReaL and verl keep the exact double; TRL rounds tau as rollshard does but divides 4 by it in float64. The
# per-token losses then part by up to 5e-8 relative, and a loss summed over mixed-sign advantages by ~1e-7
# absolute. Used only with the default 1.05; float32-exact temperatures compare at F64 (or VERL).
SAPO_F32_TAU = dict(rtol=1e-6, atol=3e-7)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One micro-batch in rollshard's packed layout, with the peers' layouts derived from it."""

    cu: torch.Tensor  # [S+1] long
    mask: torch.Tensor  # [T] float64 0/1
    rollout: torch.Tensor  # [T] mu
    prox: torch.Tensor  # [T] pi_prox
    logp: torch.Tensor  # [T] pi_theta (no graph; leaf() gives one)
    seq_adv: torch.Tensor  # [S] float64 holding float32 values

    @property
    def adv(self) -> torch.Tensor:  # [T] constant per sequence
        return self.seq_adv[sequence_ids(self.cu)]

    @property
    def on(self) -> torch.Tensor:  # [T] bool
        return self.mask > 0

    @property
    def n(self) -> int:  # loss tokens
        return int(self.mask.sum())

    @property
    def S(self) -> int:
        return len(LENGTHS)

    def leaf(self) -> torch.Tensor:  # [T] pi_theta, requires grad
        return self.logp.clone().requires_grad_(True)

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:  # slime / prime-rl: per-sample 1D tensors
        return list(x.split(LENGTHS))

    def pad(self, x: torch.Tensor) -> torch.Tensor:  # [S, L] TRL / verl: right-padded with 0 (differentiable)
        return pad_sequence(self.split(x), batch_first=True)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:  # [S, L] -> [T]
        return torch.cat([x[i, :n] for i, n in enumerate(LENGTHS)])

    def per_seq(self, values: torch.Tensor) -> torch.Tensor:  # [T] -> [S] masked mean over loss tokens
        return segment_mean(values, self.mask, self.cu)

    def seq_of(self, token_values: torch.Tensor) -> torch.Tensor:  # [T] constant per sequence -> [S]
        return token_values[self.cu[:-1]]


def make_batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    S, T = len(LENGTHS), sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    seq = sequence_ids(cu)
    mask = (torch.rand(T, generator=g) < 0.75).double()
    mask[cu[:-1]] = 1.0  # every sequence has a loss token, so the peers' per-sequence means are all defined
    logit_mu = -4.0 + 7.0 * torch.rand(T, generator=g, dtype=torch.float64)  # p_mu from 0.018 to 0.95

    def moved_off_mu() -> torch.Tensor:  # [T] a policy's logprobs, each sequence moved off mu by its own amount
        scale = DRIFTS[torch.randperm(S, generator=g)]  # [S] logit noise, from nearly on-policy to far off it
        shift = scale * torch.randn(S, generator=g, dtype=torch.float64)  # [S] and a drift of the same size
        noise = torch.randn(T, generator=g, dtype=torch.float64)
        return torch.nn.functional.logsigmoid(logit_mu + shift[seq] + scale[seq] * noise)

    rollout = torch.nn.functional.logsigmoid(logit_mu)
    prox, logp = moved_off_mu(), moved_off_mu()
    # Multiples of 1/64 below 2: exact in float32 (policy_loss casts advantages to float32) and so are their
    # products with the dual clip's 3, which rollshard computes in float32 and AReaL, slime in float64.
    sign = torch.tensor([(-1.0) ** i for i in range(S)], dtype=torch.float64)
    seq_adv = sign * torch.randint(16, 128, (S,), generator=g).double() / 64
    return Batch(cu=cu, mask=mask, rollout=rollout, prox=prox, logp=logp, seq_adv=seq_adv)


def run(b: Batch, logp: torch.Tensor, config: LossConfig, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return policy_loss(
        logp, rollout_logp=b.rollout, advantages=b.adv, loss_mask=b.mask, cu_seqlens=b.cu, config=config, **kw
    )


def grad(loss: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, logp)
    return g


def per_token(b: Batch, logp: torch.Tensor, config: LossConfig, old: torch.Tensor) -> torch.Tensor:  # [T]
    """rollshard's surrogate per token (before masks, weights and aggregation) at token ratio pi_theta / old."""
    pg, _ = surrogate(logp, torch.exp(logp - old), b.adv, config=config)
    return pg


def close(actual, expected, tol=F64, on: torch.Tensor | None = None):
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    if on is not None:
        actual, expected = actual[on], expected[on]
    torch.testing.assert_close(actual, expected, **tol)


def fires(dropped: torch.Tensor, kept: torch.Tensor, what: str):
    """The correction drops something and keeps something (else the comparison would be of a no-op)."""
    assert bool(dropped.any()), f"fires: {what} dropped nothing"
    assert bool(kept.any()), f"fires: {what} kept nothing"


# ---------------------------------------------------------------------------------------------------------------
# OPSM: drop a sequence with A < 0 whose mean log(mu / pi_theta) over its loss tokens exceeds delta.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [1e-4, 0.25])  # slime's default --opsm-delta; a larger one
@pytest.mark.parametrize("seed", SEEDS)
def test_opsm_matches_slime(seed, delta):
    """slime ``compute_opsm_mask`` and ``policy_loss_function --use-opsm --use-rollout-logprobs`` (mu is the
    rollout engine's logprob, as rollshard's)."""
    b = make_batch(seed)
    keep = corrections.opsm_keep(
        b.logp, rollout_logp=b.rollout, advantages=b.adv, mask=b.mask, cu_seqlens=b.cu, delta=delta
    )  # [T]
    args = slime.make_args(use_opsm=True, opsm_delta=delta, use_rollout_logprobs=True, eps_clip=0.2, eps_clip_high=0.28)
    masks = b.split(b.mask.long())
    slime_keep, _ = slime.compute_opsm_mask(args, b.split(b.logp), b.split(b.rollout), b.split(b.adv), masks)
    assert torch.equal(keep.double(), slime_keep)
    # slime's opsm_clipfrac sums, over samples, the dropped share of the sample's loss tokens counting every token
    # (loss-masked or not) as dropped: no rollshard metric is that figure.
    dropped, negative = ~b.seq_of(keep), b.seq_adv < 0
    fires(dropped, negative & ~dropped, "OPSM (sequences with A < 0)")

    # slime sums the per-sample token means (sum_of_sample_mean); rollshard's seq-mean-token-mean divides that by S.
    config = LossConfig(opsm_delta=delta, agg="seq-mean-token-mean", dual_clip_c=None)
    lp, lp_s = b.leaf(), b.leaf()
    slime_pg, _ = slime.compute_policy_loss(b.rollout - b.logp, b.adv, 0.2, 0.28)  # [T] before OPSM
    masked = torch.where(keep, per_token(b, b.logp, config, b.rollout), 0.0)  # [T]
    close(masked, slime_pg * slime_keep, on=b.on)
    loss, metrics = run(b, lp, config)
    batch = dict(
        advantages=b.split(b.adv), loss_masks=masks, response_lengths=list(LENGTHS), total_lengths=list(LENGTHS),
        rollout_log_probs=b.split(b.rollout),
    )
    sum_of_sample_mean = slime.get_sum_of_sample_mean(list(LENGTHS), list(LENGTHS), masks)
    slime_loss, _ = slime.policy_loss_function(args, batch, b.split(lp_s), sum_of_sample_mean)
    close(loss * b.S, slime_loss)
    close(grad(loss, lp) * b.S, grad(slime_loss, lp_s))
    close(metrics["mask/opsm"], (1 - slime_keep)[b.on].mean(), FRACTION)


@pytest.mark.parametrize("delta", [1e-4, 0.25])
@pytest.mark.parametrize("seed", SEEDS)
def test_opsm_matches_trl(seed, delta):
    """TRL ``get_off_policy_mask`` and ``_compute_loss`` with ``off_policy_mask_threshold`` (mu: the sampling
    logprobs), loss_type ``dapo``: token sum over the batch's loss-token count, rollshard's token-mean."""
    b = make_batch(seed)
    keep = corrections.opsm_keep(
        b.logp, rollout_logp=b.rollout, advantages=b.adv, mask=b.mask, cu_seqlens=b.cu, delta=delta
    )  # [T]
    trl_keep = trl.get_off_policy_mask(b.seq_adv[:, None], b.pad(b.logp), b.pad(b.rollout), b.pad(b.mask), delta)
    assert torch.equal(b.seq_of(keep).double(), trl_keep[:, 0])
    fires(~b.seq_of(keep), (b.seq_adv < 0) & b.seq_of(keep), "OPSM (sequences with A < 0)")

    config = LossConfig(opsm_delta=delta, dual_clip_c=None)  # PPO clip 0.2 / 0.28 = TRL epsilon, epsilon_high
    lp, lp_t = b.leaf(), b.leaf()
    loss, metrics = run(b, lp, config)
    trl_loss, trl_per_token, _ = trl.compute_loss(
        b.pad(lp_t), b.pad(b.rollout), b.seq_adv, b.pad(b.mask), "dapo", epsilon=0.2, epsilon_high=0.28,
        off_policy_mask_threshold=delta, sampling_per_token_logps=b.pad(b.rollout),
    )
    masked = torch.where(keep, per_token(b, b.logp, config, b.rollout), 0.0)  # [T] TRL's is after OPSM
    close(masked, b.unpad(trl_per_token.detach()), on=b.on)
    close(loss, trl_loss)
    close(grad(loss, lp), grad(trl_loss, lp_t))
    # TRL logs no OPSM figure; its mask's dropped share of the loss tokens is rollshard's mask/opsm.
    close(metrics["mask/opsm"], 1 - (trl_keep * b.pad(b.mask)).sum() / b.n, FRACTION)


# ---------------------------------------------------------------------------------------------------------------
# CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "eps",
    [None, (0.2, 0.2)],  # None: rollshard's defaults 1 / 4 (slime's recommended --eps-clip 1 --eps-clip-high 4)
)
@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_matches_slime(seed, eps):
    """slime ``compute_cispo_loss`` and ``policy_loss_function`` with ``--advantage-estimator cispo``."""
    b = make_batch(seed)
    config = LossConfig(pg_loss="cispo", agg="seq-mean-token-mean")
    if eps is not None:
        config = dataclasses.replace(config, eps_low=eps[0], eps_high=eps[1])
    eps_clip, eps_clip_high = eps or (1.0, 4.0)
    r = torch.exp(b.logp - b.rollout)[b.on]
    fires(r > 1 + eps_clip_high, r <= 1 + eps_clip_high, "CISPO upper clip")
    if eps_clip < 1:
        fires(r < 1 - eps_clip, r >= 1 - eps_clip, "CISPO lower clip")

    lp, lp_s = b.leaf(), b.leaf()
    slime_pg, _ = slime.compute_cispo_loss(b.rollout - lp_s, lp_s, b.adv, eps_clip, eps_clip_high)
    close(per_token(b, b.logp, config, b.rollout), slime_pg.detach(), on=b.on)

    # slime sums the per-sample token means; rollshard's seq-mean-token-mean divides that by S.
    args = slime.make_args(
        advantage_estimator="cispo", eps_clip=eps_clip, eps_clip_high=eps_clip_high, use_rollout_logprobs=True
    )
    masks = b.split(b.mask.long())
    batch = dict(
        advantages=b.split(b.adv), loss_masks=masks, response_lengths=list(LENGTHS), total_lengths=list(LENGTHS),
        rollout_log_probs=b.split(b.rollout),
    )
    slime_loss, _ = slime.policy_loss_function(
        args, batch, b.split(lp_s), slime.get_sum_of_sample_mean(list(LENGTHS), list(LENGTHS), masks)
    )
    loss, _ = run(b, lp, config)
    close(loss * b.S, slime_loss)
    close(grad(loss, lp) * b.S, grad(slime_loss, lp_s))


@pytest.mark.parametrize("cap", [5.0, 2.5])  # 5: TRL's documented epsilon_high, rollshard's default 1 + 4
@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_matches_trl(seed, cap):
    """TRL ``loss_type="cispo"``: the ratio capped at ``epsilon_high`` itself, no lower clip (rollshard eps_low 1,
    eps_high cap - 1); token sum over the loss-token count = rollshard's token-mean; ``cispo_clip_ratio`` is
    rollshard's ``clip/frac_high``."""
    b = make_batch(seed)
    config = LossConfig(pg_loss="cispo")  # defaults eps_low 1, eps_high 4
    if cap != 5.0:
        config = dataclasses.replace(config, eps_low=1.0, eps_high=cap - 1.0)
    lp, lp_t = b.leaf(), b.leaf()
    trl_loss, trl_per_token, trl_metrics = trl.compute_loss(
        b.pad(lp_t), b.pad(b.rollout), b.seq_adv, b.pad(b.mask), "cispo", epsilon_high=cap
    )
    loss, metrics = run(b, lp, config)
    r = torch.exp(b.logp - b.rollout)[b.on]
    fires(r > cap, r <= cap, "CISPO cap")
    assert trl_metrics["cispo_clip_ratio"] > 0, "fires: no A > 0 token above the cap"
    close(per_token(b, b.logp, config, b.rollout), b.unpad(trl_per_token.detach()), on=b.on)
    close(loss, trl_loss)
    close(grad(loss, lp), grad(trl_loss, lp_t))
    close(metrics["clip/frac_high"], trl_metrics["cispo_clip_ratio"], FRACTION)


@pytest.mark.parametrize("eps", [(0.2, 0.2), (1.0, 4.0)])  # verl's ActorConfig defaults; the paper's
@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_matches_verl(seed, eps):
    """verl ``compute_policy_loss_cispo``, ``loss_agg_mode="token-mean"`` (rollshard's token-mean)."""
    b = make_batch(seed)
    config = LossConfig(pg_loss="cispo", eps_low=eps[0], eps_high=eps[1])
    r = torch.exp(b.logp - b.rollout)[b.on]
    fires(r > 1 + eps[1], r <= 1 + eps[1], "CISPO upper clip")
    lp, lp_v = b.leaf(), b.leaf()
    verl_loss, _, verl_pg = verl.compute_policy_loss_cispo(
        b.pad(b.rollout), b.pad(lp_v), b.pad(b.adv), b.pad(b.mask), "token-mean",
        clip_ratio_low=eps[0], clip_ratio_high=eps[1],
    )
    loss, _ = run(b, lp, config)
    close(per_token(b, b.logp, config, b.rollout), b.unpad(verl_pg.detach()), on=b.on)
    close(loss, verl_loss)
    close(grad(loss, lp), grad(verl_loss, lp_v))


# ---------------------------------------------------------------------------------------------------------------
# SAPO: -(4 / tau) sigmoid(tau (r - 1)) A, tau by the sign of A.
# ---------------------------------------------------------------------------------------------------------------

SAPO_TAUS = [None, (2.0, 0.5)]  # None: the defaults 1.0 / 1.05 of rollshard, AReaL, TRL and verl


def sapo_config(taus, **kw) -> tuple[LossConfig, float, float]:
    config = LossConfig(pg_loss="sapo", **kw)
    if taus is not None:
        config = dataclasses.replace(config, sapo_tau_pos=taus[0], sapo_tau_neg=taus[1])
    tau_pos, tau_neg = taus or (1.0, 1.05)
    return config, tau_pos, tau_neg


def sapo_fires(b: Batch, old: torch.Tensor):
    """Some loss tokens sit where the gate has flattened: sigmoid'(tau (r - 1)) * 4 below 0.5 at tau 1, i.e. more
    than 1.76 from r = 1; others close to r = 1 where the gate is the plain policy gradient."""
    r = torch.exp(b.logp - old)[b.on]
    fires((r - 1).abs() > 1.76, (r - 1).abs() < 0.2, "SAPO's soft gate away from r = 1")


@pytest.mark.parametrize("taus", SAPO_TAUS)
@pytest.mark.parametrize("seed", SEEDS)
def test_sapo_matches_areal(seed, taus):
    """AReaL ``sapo_loss_fn`` through ``grpo_loss_fn(use_sapo_loss=True)`` (packed 1D, as rollshard), token mean;
    its ``sapo_soft_gate`` avg / min / max are rollshard's ``sapo/soft_gate_mean`` / ``_min`` / ``_max``."""
    b = make_batch(seed)
    config, tau_pos, tau_neg = sapo_config(taus)
    tol = SAPO_F32_TAU if taus is None else F64
    sapo_fires(b, b.rollout)
    lp, lp_a = b.leaf(), b.leaf()
    # AReaL's SAPO takes its ratio against old_logp (the behaviour policy mu); prox_logp is read only by M2PO.
    input_data = dict(logprobs=b.rollout, prox_logp=b.rollout, advantages=b.adv, loss_mask=b.on, cu_seqlens=b.cu)
    areal_loss, dens, stats = areal.grpo_loss_fn(
        lp_a, input_data, use_sapo_loss=True, sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg
    )
    _, stat = areal.sapo_loss_fn(b.logp, b.rollout, b.adv, tau_pos, tau_neg, b.on)
    loss, metrics = run(b, lp, config)
    close(per_token(b, b.logp, config, b.rollout), stat["_per_token_loss"], tol, on=b.on)
    close(loss, areal_loss, tol)
    close(grad(loss, lp), grad(areal_loss, lp_a), tol)
    exported = areal.export_stats(dens, stats)
    for mine, theirs in (("mean", "avg"), ("min", "min"), ("max", "max")):
        close(metrics[f"sapo/soft_gate_{mine}"], exported[f"sapo_soft_gate/{theirs}"], tol)


@pytest.mark.parametrize("taus", SAPO_TAUS)
@pytest.mark.parametrize("seed", SEEDS)
def test_sapo_matches_trl(seed, taus):
    """TRL ``loss_type="sapo"``: the mean over sequences of each one's token mean = rollshard's seq-mean-token-mean
    (every sequence has a loss token)."""
    b = make_batch(seed)
    config, tau_pos, tau_neg = sapo_config(taus, agg="seq-mean-token-mean")
    tol = SAPO_F32_TAU if taus is None else F64
    sapo_fires(b, b.rollout)
    lp, lp_t = b.leaf(), b.leaf()
    trl_loss, trl_per_token, _ = trl.compute_loss(
        b.pad(lp_t), b.pad(b.rollout), b.seq_adv, b.pad(b.mask), "sapo",
        sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg,
    )
    loss, _ = run(b, lp, config)
    close(per_token(b, b.logp, config, b.rollout), b.unpad(trl_per_token.detach()), tol, on=b.on)
    close(loss, trl_loss, tol)
    close(grad(loss, lp), grad(trl_loss, lp_t), tol)


@pytest.mark.parametrize("taus", SAPO_TAUS)
@pytest.mark.parametrize("seed", SEEDS)
def test_sapo_matches_verl(seed, taus):
    """verl ``compute_policy_loss_sapo``: it ignores ``loss_agg_mode`` and always takes seq-mean-token-mean, so
    asked for token-mean it still equals rollshard's seq-mean-token-mean (and not rollshard's token-mean)."""
    b = make_batch(seed)
    config, tau_pos, tau_neg = sapo_config(taus, agg="seq-mean-token-mean")
    tol = SAPO_F32_TAU if taus is None else VERL
    sapo_fires(b, b.rollout)
    lp, lp_v = b.leaf(), b.leaf()
    verl_loss, _, verl_pg = verl.compute_policy_loss_sapo(
        b.pad(b.rollout), b.pad(lp_v), b.pad(b.adv), b.pad(b.mask), "token-mean", tau_pos=tau_pos, tau_neg=tau_neg
    )
    loss, _ = run(b, lp, config)
    pg_tol = SAPO_F32_TAU if taus is None else F64  # verl's 1e-8 touches only the aggregated loss
    close(per_token(b, b.logp, config, b.rollout), b.unpad(verl_pg.detach()), pg_tol, on=b.on)
    close(loss, verl_loss, tol)
    close(grad(loss, lp), grad(verl_loss, lp_v), tol)
    token_mean, _ = run(b, b.logp, dataclasses.replace(config, agg="token-mean"))
    assert abs(float(token_mean) - float(verl_loss.detach())) > 1e-3  # the aggregation verl forces is one that matters


# ---------------------------------------------------------------------------------------------------------------
# DPPO (prime-rl's default loss): -keep A r, keep the binary TV mask, plus kl_tau (log pi_theta - log mu)^2.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_adv", [False, True])  # True: a sequence with a low-side token gets A = 0
@pytest.mark.parametrize("kl_tau", [None, 0.05])  # None: the defaults (kl_tau 1e-3, masks 0.2 / 0.2) of both
@pytest.mark.parametrize("seed", SEEDS)
def test_dppo_matches_prime_rl(seed, kl_tau, zero_adv):
    """prime-rl ``default_loss_fn`` per sample through ``compute_loss`` (the sum over ``rl_scale``, the loss-token
    count: rollshard's token-mean), its keep mask and per-token loss, and its ``is_masked*`` metrics: prime-rl
    averages them per sample, so their token-weighted mean over the samples is rollshard's batch figure."""
    b = make_batch(seed)
    config, pcfg = LossConfig(pg_loss="dppo"), prime_rl.DefaultLossConfig()
    if kl_tau is not None:
        config, pcfg = dataclasses.replace(config, dppo_kl_tau=kl_tau), prime_rl.DefaultLossConfig(kl_tau=kl_tau)
    below = (torch.exp(b.logp) - torch.exp(b.rollout) < -pcfg.dppo_mask_low) & b.on  # [T] whatever A's sign
    flat = int(sequence_ids(b.cu)[below][0]) if bool(below.any()) else -1  # the sequence of the first such token
    if zero_adv:  # a zero-variance group: A = 0, which prime-rl's where(A > 0, high, low) puts on the low side
        b = dataclasses.replace(b, seq_adv=torch.where(torch.arange(b.S) == flat, 0.0, b.seq_adv))
    high, low = corrections.dppo_masks(
        b.logp, rollout_logp=b.rollout, advantages=b.adv, low=config.dppo_mask_low, high=config.dppo_mask_high
    )  # [T] each
    fires(high[b.on], ~high[b.on], "DPPO high side")
    fires(low[b.on], ~low[b.on], "DPPO low side")

    lp, lp_p = b.leaf(), b.leaf()
    masks = b.split(b.on)
    outs = [
        prime_rl.default_loss_fn(prime_rl.LossInputs(t, i, None, a, m), pcfg)
        for t, i, a, m in zip(b.split(b.logp), b.split(b.rollout), b.split(b.adv), masks)
    ]
    assert torch.equal(high | low, torch.cat([o.extras["is_masked"] for o in outs]))
    kl = config.dppo_kl_tau * (b.logp - b.rollout).square()  # [T] on every loss token, dropped or not
    expected = torch.where(high | low, 0.0, per_token(b, b.logp, config, b.rollout)) + kl
    close(expected, torch.cat([o.extras["per_token_loss"] for o in outs]).detach(), on=b.on)

    prime_loss, prime_metrics = prime_rl.compute_loss(
        b.split(lp_p), b.split(b.rollout), None, b.split(b.adv), masks, None, prime_rl.setup_rl_loss_fn(pcfg), b.n
    )
    loss, metrics = run(b, lp, config)
    close(loss, prime_loss)
    close(grad(loss, lp), grad(prime_loss, lp_p))

    counts = segment_sum(b.mask, b.cu)  # [S] loss tokens of each sample

    def token_weighted(name: str) -> torch.Tensor:
        return (prime_metrics[name].double() * counts).sum() / counts.sum()

    close(metrics["mask/dppo_high"], token_weighted("is_masked_high"), FRACTION)
    close(metrics["mask/any"], token_weighted("is_masked"), FRACTION)
    # rollshard's mask/dppo_low counts a token with A == 0 (dropped, as prime-rl's is_masked drops it);
    # prime-rl's is_masked_low counts only A < 0. They part by the zero-advantage tokens on the low side.
    zero_low = (below & (b.adv == 0)).sum() / b.n
    assert bool(zero_low > 0) == zero_adv
    close(metrics["mask/dppo_low"], token_weighted("is_masked_low") + zero_low, FRACTION)


# ---------------------------------------------------------------------------------------------------------------
# M2PO: drop the micro-batch's largest (log pi_prox - log mu)^2 until the mean of the rest is below tau.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tau", [0.04, 0.3, 1e-9])  # AReaL's example; a looser one; none reachable: 1 token kept
@pytest.mark.parametrize("seed", SEEDS)
def test_m2po_matches_areal(seed, tau):
    """AReaL ``_apply_m2po_masking`` (old_logp = mu, prox_logp = pi_prox) and ``grpo_loss_fn`` with
    ``m2_threshold`` on the decoupled PPO path (no behaviour weight: rollshard is_correction none)."""
    b = make_batch(seed)
    keep = corrections.m2po_keep(b.prox - b.rollout, b.mask, tau=tau)  # [T]
    areal_mask = areal._apply_m2po_masking(b.rollout, b.prox, b.on, tau)
    assert torch.equal(keep & b.on, areal_mask)
    assert bool(keep[~b.on].all())  # off-mask tokens carry no loss and stay kept
    kept = int(areal_mask.sum())
    fires((~keep)[b.on], keep[b.on], "M2PO")
    if tau == 1e-9:
        assert kept == 1  # the fallback: only the smallest (log w)^2 stays

    config = LossConfig(mode="decoupled", is_correction="none", m2po_tau=tau)  # PPO 0.2 / 0.28, dual clip 3
    lp, lp_a = b.leaf(), b.leaf()
    input_data = dict(logprobs=b.rollout, prox_logp=b.prox, advantages=b.adv, loss_mask=b.on, cu_seqlens=b.cu)
    areal_loss, dens, _ = areal.grpo_loss_fn(
        lp_a, input_data, eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0, m2_threshold=tau
    )
    _, stat = areal.ppo_actor_loss_fn(
        b.logp, b.prox, b.rollout, b.adv, 0.2, areal_mask, eps_clip_higher=0.28, c_clip=3.0
    )  # AReaL's per-token loss (its ratio is 0 off its mask, so only the kept tokens compare)
    close(per_token(b, b.logp, config, b.prox), stat["_per_token_loss"], on=areal_mask)
    loss, metrics = run(b, lp, config, prox_logp=b.prox)
    # AReaL divides by the loss tokens left after M2PO (ppo_actor_loss_fn's loss_mask_count, the engine's scale is
    # 1 for one micro-batch); rollshard by all of them: the masked sums agree.
    close(loss * b.n, areal_loss * kept)
    close(grad(loss, lp) * b.n, grad(areal_loss, lp_a) * kept)
    assert int(dens["n_valid_tokens"].sum()) == kept
    close(metrics["mask/m2po"], 1.0 - kept / b.n, FRACTION)


# ---------------------------------------------------------------------------------------------------------------
# Geo-RS and K3-RS (verl's rollout_rs seq_mean_k1 / seq_mean_k3 / seq_sum_k3), in both modes: decoupled compares
# pi_prox with mu; bypass compares pi_theta (detached) with mu, as verl's bypass mode does inside the loss.
# ---------------------------------------------------------------------------------------------------------------


def verl_rs(b: Batch, mode: str, rollout_rs: str, threshold) -> tuple[torch.Tensor, dict]:
    """verl's RS mask ``[S, L]`` and metrics: the trainer's (decoupled, old_log_prob = pi_prox) or the loss's
    (bypass, log_prob = pi_theta)."""
    if mode == "decoupled":
        _, rs_mask, metrics = verl.compute_rollout_correction_and_rejection_mask(
            b.pad(b.prox), b.pad(b.rollout), b.pad(b.mask), rollout_rs=rollout_rs, rollout_rs_threshold=threshold
        )
        return rs_mask, metrics
    return verl.bypass_mode_rejection(b.pad(b.logp), b.pad(b.rollout), b.pad(b.mask), rollout_rs, threshold)


@pytest.mark.parametrize("bounds", [(0.8, 1.5), (1 / 1.25, 1.25)])  # asymmetric: pins the orientation
@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
@pytest.mark.parametrize("seed", SEEDS)
def test_geo_rs_matches_verl(seed, mode, bounds):
    """verl ``compute_rollout_rejection_mask(rollout_rs="seq_mean_k1")``. rollshard keeps the geometric mean of
    pi_prox / mu in [lo, hi]; verl tests k1 = -mean log(pi_prox / mu) against [log a, log b] of its threshold
    "a_b", so rollshard (lo, hi) is verl "1/hi_1/lo". Then CISPO on verl's mask (``compute_policy_loss_cispo``,
    token-mean) against rollshard's CISPO with Geo-RS; ``rollout_rs_masked_fraction`` is ``mask/geo_rs``."""
    b = make_batch(seed)
    lo, hi = bounds
    pi_prox = b.prox if mode == "decoupled" else b.logp
    keep = corrections.geo_rs_keep(pi_prox - b.rollout, b.mask, b.cu, low=lo, high=hi)  # [T]
    rs_mask, rs_metrics = verl_rs(b, mode, "seq_mean_k1", f"{1 / hi!r}_{1 / lo!r}")
    assert torch.equal(b.pad(keep.double() * b.mask), rs_mask)
    geo = torch.exp(b.per_seq(pi_prox - b.rollout))  # [S]
    fires(geo > hi, b.seq_of(keep), "Geo-RS above hi")
    fires(geo < lo, b.seq_of(keep), "Geo-RS below lo")
    # verl's threshold with rollshard's numbers "lo_hi" keeps mu / pi_prox in [lo, hi]: another set unless lo = 1/hi.
    same_numbers, _ = verl_rs(b, mode, "seq_mean_k1", f"{lo!r}_{hi!r}")
    if math.isclose(lo * hi, 1.0):
        assert torch.equal(same_numbers, rs_mask)
    else:
        in_between = ((geo > 1 / hi) & (geo < lo)) | ((geo > 1 / lo) & (geo <= hi))  # [S] where the two sets part
        assert bool(in_between.any()), "fires: no sequence tells [lo, hi] from [1/hi, 1/lo]"
        assert not torch.equal(same_numbers, rs_mask)

    # verl's RS replaces the response mask, the loss's normalizer too: it divides by the kept tokens, rollshard by
    # all of them.
    config = LossConfig(pg_loss="cispo", mode=mode, is_correction="none", geo_rs=(lo, hi))
    lp, lp_v = b.leaf(), b.leaf()
    old = b.prox if mode == "decoupled" else b.rollout
    verl_loss, _, _ = verl.compute_policy_loss_cispo(
        b.pad(old), b.pad(lp_v), b.pad(b.adv), rs_mask, "token-mean", clip_ratio_low=1.0, clip_ratio_high=4.0
    )
    loss, metrics = run(b, lp, config, prox_logp=b.prox if mode == "decoupled" else None)
    kept = float(rs_mask.sum())
    close(loss * b.n, verl_loss * kept)
    close(grad(loss, lp) * b.n, grad(verl_loss, lp_v) * kept)
    close(metrics["mask/geo_rs"], rs_metrics["rollout_corr/rollout_rs_masked_fraction"], VERL)


@pytest.mark.parametrize("reduce, threshold", [("mean", 0.05), ("sum", 0.3)])
@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
@pytest.mark.parametrize("seed", SEEDS)
def test_k3_rs_matches_verl(seed, mode, reduce, threshold):
    """verl ``compute_rollout_rejection_mask(rollout_rs="seq_mean_k3" / "seq_sum_k3")``, then SAPO on verl's mask
    (``compute_policy_loss_sapo``, seq-mean-token-mean) against rollshard's SAPO with K3-RS;
    ``rollout_rs_masked_fraction`` is ``mask/k3_rs``."""
    b = make_batch(seed)
    pi_prox = b.prox if mode == "decoupled" else b.logp
    keep = corrections.k3_rs_keep(pi_prox - b.rollout, b.mask, b.cu, threshold=threshold, reduce=reduce)  # [T]
    rs_mask, rs_metrics = verl_rs(b, mode, f"seq_{reduce}_k3", threshold)
    assert torch.equal(b.pad(keep.double() * b.mask), rs_mask)
    fires(~b.seq_of(keep), b.seq_of(keep), f"K3-RS {reduce}")

    # verl's seq-mean-token-mean counts the sequences left in its mask; rollshard counts all of them.
    config = LossConfig(
        pg_loss="sapo", sapo_tau_neg=0.5, mode=mode, is_correction="none", k3_rs=threshold, k3_rs_reduce=reduce,
        agg="seq-mean-token-mean",
    )
    lp, lp_v = b.leaf(), b.leaf()
    old = b.prox if mode == "decoupled" else b.rollout
    verl_loss, _, _ = verl.compute_policy_loss_sapo(b.pad(old), b.pad(lp_v), b.pad(b.adv), rs_mask, tau_neg=0.5)
    loss, metrics = run(b, lp, config, prox_logp=b.prox if mode == "decoupled" else None)
    kept = int(b.seq_of(keep).sum())
    close(loss * b.S, verl_loss * kept, VERL)
    close(grad(loss, lp) * b.S, grad(verl_loss, lp_v) * kept, VERL)
    close(metrics["mask/k3_rs"], rs_metrics["rollout_corr/rollout_rs_masked_fraction"], VERL)


# ---------------------------------------------------------------------------------------------------------------
# Two-sided masking (IcePop / MIS) and truncation (TIS) of the weight pi_prox / mu in decoupled mode.
# ---------------------------------------------------------------------------------------------------------------

TRL_IS_CASES = [  # (TRL vllm_importance_sampling_mode, clip_min); clip_max is TRL's default 3.0
    ("token_mask", None),
    ("token_mask", 0.5),
    ("sequence_mask", None),
    ("sequence_mask", 0.5),
    ("token_truncate", None),
    ("sequence_truncate", None),
]


@pytest.mark.parametrize("is_mode, clip_min", TRL_IS_CASES)
@pytest.mark.parametrize("seed", SEEDS)
def test_is_weight_matches_trl(seed, is_mode, clip_min):
    """TRL ``vllm_importance_sampling_ratio`` (old = pi_prox, sampling = mu) times ``_compute_loss`` (dapo: token
    mean). ``*_mask``: rollshard MIS with mis_low = clip_min (None: 0), mis_high = clip_max; ``*_truncate``: TIS
    with tis_c = clip_max; ``token_*`` / ``sequence_*``: is_level token / sequence (the product). TRL's
    ``sampling/importance_sampling_ratio`` min / max are rollshard's ``is/min`` / ``is/max``, and its mean is
    ``is/mean`` in the token modes (the sequence modes average over sequences, rollshard over tokens)."""
    b = make_batch(seed)
    clip_max, level = 3.0, is_mode.split("_")[0]
    if is_mode.endswith("mask"):
        kind = dict(is_correction="mis", mis_low=clip_min or 0.0, mis_high=clip_max)
    else:
        kind = dict(is_correction="tis", tis_c=clip_max)
    config = LossConfig(mode="decoupled", is_level=level, dual_clip_c=None, **kind)  # PPO 0.2 / 0.28
    log_w = b.prox - b.rollout
    if level == "token":
        w = torch.exp(log_w)[b.on]
    else:
        w = torch.exp(segment_sum(log_w * b.mask, b.cu))  # [S] the product over each sequence's loss tokens
        assert bool((w.log().abs() < 20).all())  # inside rollshard's log-ratio clamp
    fires(w > clip_max, w <= clip_max, f"{is_mode} above clip_max")
    if clip_min is not None:
        fires(w < clip_min, w >= clip_min, f"{is_mode} below clip_min")

    pad_prox, pad_rollout, pad_mask = b.pad(b.prox), b.pad(b.rollout), b.pad(b.mask)
    trl_w = trl.vllm_importance_sampling_ratio(pad_prox, pad_rollout, pad_mask, is_mode, clip_min, clip_max)
    lp, lp_t = b.leaf(), b.leaf()
    trl_loss, _, _ = trl.compute_loss(
        b.pad(lp_t), pad_prox, b.seq_adv, pad_mask, "dapo", epsilon=0.2, epsilon_high=0.28,
        importance_sampling_ratio=trl_w,
    )
    loss, metrics = run(b, lp, config, prox_logp=b.prox)
    close(loss, trl_loss)
    close(grad(loss, lp), grad(trl_loss, lp_t))
    trl_metrics = trl.vllm_importance_sampling_metrics(pad_prox, pad_rollout, trl_w, pad_mask, is_mode)
    close(metrics["is/min"], trl_metrics["sampling/importance_sampling_ratio/min"])
    close(metrics["is/max"], trl_metrics["sampling/importance_sampling_ratio/max"])
    if level == "token":
        close(metrics["is/mean"], trl_metrics["sampling/importance_sampling_ratio/mean"])


@pytest.mark.parametrize("icepop", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_icepop_and_tis_match_slime(seed, icepop):
    """slime ``icepop_function`` (``--custom-tis-function-path``; weight kept in [tis_clip_low, tis_clip], else 0:
    rollshard MIS) and ``vanilla_tis_function`` (``--use-tis``: clamp at tis_clip, low 0: rollshard TIS at its
    default C = 2, slime's default --tis-clip), per token, through ``policy_loss_function`` with the recomputed old
    logprobs = pi_prox (PPO ratio pi_theta / pi_prox, as rollshard's decoupled mode). slime's per-token
    ``tis_clipfrac`` averaged over the loss tokens is rollshard's ``is/frac_dropped``."""
    b = make_batch(seed)
    w = torch.exp(b.prox - b.rollout)[b.on]
    fires(w > 2.0, w <= 2.0, "weight above 2")
    if icepop:
        fires(w < 0.5, w >= 0.5, "IcePop weight below 0.5")
        config = LossConfig(mode="decoupled", is_correction="mis", mis_low=0.5, mis_high=2.0)
        args = slime.make_args(
            use_tis=True, eps_clip_high=0.28, tis_clip_low=0.5, custom_tis_function=slime.icepop_function
        )
    else:
        config = LossConfig(mode="decoupled", is_correction="tis")
        args = slime.make_args(use_tis=True, eps_clip_high=0.28)
    # slime --eps-clip 0.2 --eps-clip-high 0.28 are rollshard's PPO defaults; slime's dual clip is off by default.
    config = dataclasses.replace(config, agg="seq-mean-token-mean", dual_clip_c=None)

    masks = b.split(b.mask.long())
    batch = dict(
        advantages=b.split(b.adv), loss_masks=masks, response_lengths=list(LENGTHS), total_lengths=list(LENGTHS),
        log_probs=b.split(b.prox), rollout_log_probs=b.split(b.rollout),
    )
    lp, lp_s = b.leaf(), b.leaf()
    slime_loss, _ = slime.policy_loss_function(
        args, batch, b.split(lp_s), slime.get_sum_of_sample_mean(list(LENGTHS), list(LENGTHS), masks)
    )
    loss, metrics = run(b, lp, config, prox_logp=b.prox)
    # slime sums the per-sample token means; rollshard's seq-mean-token-mean divides that by S.
    close(loss * b.S, slime_loss)
    close(grad(loss, lp) * b.S, grad(slime_loss, lp_s))

    tis_function = args.custom_tis_function or slime.vanilla_tis_function
    _, _, tis_metrics = tis_function(
        args, pg_loss=torch.zeros_like(b.logp), train_log_probs=b.split(b.prox),
        rollout_log_probs=b.split(b.rollout), loss_masks=masks,
    )
    close(metrics["is/frac_dropped"], tis_metrics["tis_clipfrac"][b.on].mean(), FRACTION)

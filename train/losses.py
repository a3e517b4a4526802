"""Policy losses of GRPO from stored rollouts (pure functions of tensors -> ``(loss, metrics)``).

Token ``t`` of sequence ``i``, mask ``m``, advantage ``A`` (REFERENCE.md "Loss formulas"):

* ratio ``rho = exp(logp - logp_old)``, the log-ratio clamped to
  ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp``. ``logp_old`` is the stored
  rollout logprob (bypass mode, the default: slime ``--use-rollout-logprobs``, verl
  bypass) or the proximal policy's logprob recomputed once per step (decoupled mode,
  AReaL).
* PPO clip, clip-higher: ``L = max(-rho A, -clip(rho, 1 - eps_low, 1 + eps_high) A)``;
  dual clip for ``A < 0``: ``L = min(L, -c A)``. Unset ``eps_low`` / ``eps_high``
  (``None``) take the default of the ratio level (``LossConfig.clip_range``):
  0.2 / 0.28 for token ratios (DAPO), 3e-4 / 4e-4 for sequence ratios (GSPO).
* GSPO (``ratio_level="sequence"``): ``s_i = exp(mean_t m (logp - logp_old))``, used
  per token as ``s_i * exp(logp_t - sg(logp_t))`` so its value is ``s_i`` and its
  gradient is GSPO's (verl's "GSPO-token" form), clipped at GSPO's 3e-4 / 4e-4 unless
  set. With every token of a sequence at the same log-ratio and the same eps it
  equals the token-level loss exactly.
* Decoupled mode: ``rho = pi / pi_prox`` and the clipped loss is multiplied by the
  (constant) importance weight ``w = pi_prox / pi_rollout``: truncated ``min(w, C)``
  (TIS) or masked ``w * [a <= w <= b]`` (MIS, icepop), per token, per sequence (the
  product over the sequence) or per sequence geometric mean.
* Aggregation, normalized by counts of the *global* batch (:class:`LossNorm`: every
  micro-batch of the optimizer step on every data-parallel rank) so that summing the
  micro-batch gradients equals the gradient of one large batch:
  token-mean ``sum(m L) / n_tokens``; seq-mean-token-mean
  ``sum_i (sum_t m L / sum_t m) / n_seqs``; seq-mean-token-sum-norm (Dr. GRPO)
  ``sum(m L) / (n_seqs * norm_len)``, ``norm_len`` a constant: the trainer passes one
  for the whole run (``--norm-len``, else the dataset's ``max_new_tokens`` times the
  model turns per row), so the loss scale does not move from step to step, as in
  Dr. GRPO and verl. Called without one, :class:`LossNorm` falls back to the most loss
  tokens (``sum_t m``) of any sequence of the batch it is given.
* Other surrogates (``--pg-loss cispo | sapo | dppo``) replace the clipped one, and masks (OPSM, M2PO, Geo-RS,
  K3-RS, DPPO's TV mask) zero the policy loss of the tokens or sequences they drop, before the importance weight;
  a dropped token still counts in the normalizer (TRL, slime, prime-rl). Their formulas, the policies each
  compares and the peers' code each follows: :mod:`rollshard.train.corrections`.
* Optional KL to a frozen reference, ``lr = logp - logp_ref``: k1 ``lr``,
  k2 ``lr^2 / 2``, k3 ``min(exp(-lr) - 1 + lr, KL_K3_CLAMP)`` (verl's clamp at 10); and an
  entropy bonus.
* Sampling supports (:mod:`rollshard.train.support`): the caller passes as ``logp`` /
  ``rollout_logp`` / ``prox_logp`` the logprobs renormalized over the engine's sampling
  support where a token has one, and the full-softmax policy logprob as ``kl_logp``, which
  the KL term uses (the KL is on the full distributions).

Metrics are local to the micro-batch (``mask/<name>``: the share of valid tokens a correction dropped); means are over its valid tokens (combine them
weighted by ``tokens``), ``*_min`` / ``*_max`` by min / max, ``loss/*`` by sum.
The importance-weight statistics (``is/*``) describe ``pi_prox / pi_rollout`` in
decoupled mode and ``pi / pi_rollout`` (the ratio itself) in bypass mode.
"""

from __future__ import annotations

import dataclasses

import torch

from rollshard.train import corrections
from rollshard.train.config import LossConfig
from rollshard.train.segments import segment_sum, sequence_ids

# Log-ratios are clamped to +-20 before exp: exp(20) ~ 4.9e8 stays finite in fp32 (and
# so does its square in the metrics), while a real mismatch that large is clipped by
# PPO anyway. Without it one bad token (a dropped logprob, a wrong temperature) makes
# the loss inf/NaN for the whole step.
LOG_RATIO_CLAMP = 20.0
# The k3 KL value is clamped at 10, as verl does (core_algos.kl_penalty "low_var_kl": the log-ratio at +-20,
# then the k3 value at [-10, 10]; k3 >= 0, so only the top binds). k3 grows like exp(logp_ref - logp): a token
# 5 nats less likely than under the reference would add 142 to the KL term with a gradient of -147 and
# outweigh the whole policy loss; clamped, it adds 10 and no gradient. Below the clamp (logp_ref - logp up to
# ~2.6 nats, logp - logp_ref up to ~11) the estimator is unchanged.
KL_K3_CLAMP = 10.0


@dataclasses.dataclass(kw_only=True, frozen=True)
class LossNorm:
    """Normalizers of the global batch (sums over micro-batches and ranks)."""

    tokens: float  # tokens with loss_mask > 0
    sequences: float  # sequences with at least one such token
    norm_len: float  # length constant of seq-mean-token-sum-norm: max loss tokens of a sequence

    @classmethod
    def of(
        cls,
        loss_mask: torch.Tensor,  # [T]
        cu_seqlens: torch.Tensor,  # [S+1]
        *,
        norm_len: float | None = None,
    ) -> "LossNorm":
        """The normalizers of one micro-batch alone (combine several with :meth:`combine`)."""
        counts = segment_sum(loss_mask.float(), cu_seqlens)  # [S]
        return cls(
            tokens=float(counts.sum()),
            sequences=float((counts > 0).sum()),
            norm_len=float(norm_len if norm_len is not None else (counts.max() if counts.numel() else 0.0)),
        )

    @classmethod
    def combine(cls, parts: list["LossNorm"], *, norm_len: float | None = None) -> "LossNorm":
        return cls(
            tokens=sum(p.tokens for p in parts),
            sequences=sum(p.sequences for p in parts),
            norm_len=float(norm_len if norm_len is not None else max((p.norm_len for p in parts), default=0.0)),
        )


def aggregate(
    values: torch.Tensor,  # [T] per-token loss
    mask: torch.Tensor,  # [T] float
    cu_seqlens: torch.Tensor,  # [S+1]
    *,
    agg: str,
    norm: LossNorm,
) -> torch.Tensor:  # []
    """Masked aggregation of a per-token loss, normalized by the global batch's counts."""
    if agg == "token-mean":
        return (values * mask).sum() / max(norm.tokens, 1.0)
    if agg == "seq-mean-token-mean":
        per_seq = segment_sum(values * mask, cu_seqlens) / segment_sum(mask, cu_seqlens).clamp(min=1.0)  # [S]
        return per_seq.sum() / max(norm.sequences, 1.0)
    if agg == "seq-mean-token-sum-norm":
        return (values * mask).sum() / max(norm.sequences * norm.norm_len, 1.0)
    raise ValueError(f"unknown aggregation {agg!r}; use token-mean, seq-mean-token-mean or seq-mean-token-sum-norm")


def kl_penalty(
    logp: torch.Tensor,  # [T]
    ref_logp: torch.Tensor,  # [T]
    kind: str,
) -> torch.Tensor:  # [T]
    """Per-token KL estimator of KL(pi || pi_ref) from samples of pi (k1, k2, k3; Schulman 2020)."""
    lr = (logp - ref_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return lr
    if kind == "k2":
        return 0.5 * lr * lr
    if kind == "k3":
        return (torch.exp(-lr) - 1.0 + lr).clamp(max=KL_K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def importance_weight(
    prox_logp: torch.Tensor,  # [T]
    rollout_logp: torch.Tensor,  # [T]
    mask: torch.Tensor,  # [T]
    cu_seqlens: torch.Tensor,  # [S+1]
    *,
    level: str,
) -> torch.Tensor:  # [T]
    """``pi_prox / pi_rollout`` per token, or per sequence (product / geometric mean) broadcast to tokens."""
    lr = (prox_logp - rollout_logp).detach() * mask  # [T]
    if level == "token":
        return torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    seq = segment_sum(lr, cu_seqlens)  # [S] log of the product
    if level == "geometric":
        seq = seq / segment_sum(mask, cu_seqlens).clamp(min=1.0)
    elif level != "sequence":
        raise ValueError(f"unknown importance-weight level {level!r}; use token, sequence or geometric")
    return torch.exp(seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[sequence_ids(cu_seqlens)]


def policy_loss(
    logp: torch.Tensor,  # [T] current policy, requires grad
    *,
    rollout_logp: torch.Tensor,  # [T] stored engine logprobs
    advantages: torch.Tensor,  # [T]
    loss_mask: torch.Tensor,  # [T]
    cu_seqlens: torch.Tensor,  # [S+1]
    config: LossConfig,
    norm: LossNorm | None = None,
    prox_logp: torch.Tensor | None = None,  # [T] decoupled mode: proximal policy, no grad
    ref_logp: torch.Tensor | None = None,  # [T] reference policy, for kl_coef > 0
    entropy: torch.Tensor | None = None,  # [T] policy entropy, for entropy_coef > 0
    kl_logp: torch.Tensor | None = None,  # [T] the policy logprob the KL compares to ref_logp; default logp
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch (its share of the global batch's loss) and its metrics."""
    cfg = config
    mask = loss_mask.float()  # [T]
    if norm is None:
        norm = LossNorm.of(loss_mask, cu_seqlens, norm_len=cfg.norm_len)
    if cfg.mode == "decoupled":
        if prox_logp is None:
            raise ValueError("decoupled mode needs prox_logp (the proximal policy's logprobs)")
        old = prox_logp.detach()
    elif cfg.mode == "bypass":
        old = rollout_logp
    else:
        raise ValueError(f"unknown loss mode {cfg.mode!r}; use bypass or decoupled")

    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask  # [T]
    if cfg.ratio_level == "sequence":
        seq_lr = segment_sum(log_ratio.detach(), cu_seqlens) / segment_sum(mask, cu_seqlens).clamp(min=1.0)  # [S]
        log_ratio = (logp - logp.detach()) * mask + seq_lr[sequence_ids(cu_seqlens)]  # [T] value s_i, GSPO grad
    elif cfg.ratio_level != "token":
        raise ValueError(f"unknown ratio level {cfg.ratio_level!r}; use token or sequence")
    ratio = torch.exp(log_ratio)  # [T]

    A = advantages.float()  # [T]
    pg, extra = surrogate(logp, ratio, A, config=cfg)  # [T]

    if cfg.mode == "decoupled":
        ratio_seen = ratio.detach()
        w = importance_weight(prox_logp, rollout_logp, mask, cu_seqlens, level=cfg.is_level)  # [T]
        if cfg.is_correction == "tis":
            w_used = w.clamp(max=cfg.tis_c)
            dropped = w > cfg.tis_c
        elif cfg.is_correction == "mis":
            kept = (w >= cfg.mis_low) & (w <= cfg.mis_high)
            w_used = torch.where(kept, w, torch.zeros_like(w))
            dropped = ~kept
        elif cfg.is_correction == "none":
            w_used, dropped = torch.ones_like(w), None
        else:
            raise ValueError(f"unknown importance correction {cfg.is_correction!r}; use tis, mis or none")
        pg = pg * w_used
    else:
        w_used = ratio_seen = ratio.detach()  # the same tensor: token_metrics reads its figures once
        dropped = None  # bypass drops no token

    # The trained policy's own logprobs stand in for the proximal policy's in bypass mode (module docstring of
    # rollshard.train.corrections).
    masks = correction_masks(
        logp, rollout_logp=rollout_logp, prox_logp=prox_logp if cfg.mode == "decoupled" else logp, advantages=A,
        mask=mask, cu_seqlens=cu_seqlens, config=cfg,
    )
    if masks:
        keep = torch.stack(list(masks.values())).all(dim=0)  # [T]
        pg = torch.where(keep, pg, torch.zeros_like(pg))
    if cfg.pg_loss == "dppo" and cfg.dppo_kl_tau > 0:  # prime-rl: on every loss token, masked or not
        pg = pg + cfg.dppo_kl_tau * (logp - rollout_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).square()

    pg_loss = aggregate(pg, mask, cu_seqlens, agg=cfg.agg, norm=norm)
    loss = pg_loss
    metrics: dict[str, torch.Tensor] = {"loss/policy": pg_loss.detach()}
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (the reference policy's logprobs)")
        kl_lp = logp if kl_logp is None else kl_logp
        kl = aggregate(kl_penalty(kl_lp, ref_logp, cfg.kl_type), mask, cu_seqlens, agg=cfg.agg, norm=norm)
        loss = loss + cfg.kl_coef * kl
        metrics["loss/kl"] = kl.detach()
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the policy entropy per token")
        ent = aggregate(entropy, mask, cu_seqlens, agg=cfg.agg, norm=norm)
        loss = loss - cfg.entropy_coef * ent
        metrics["loss/entropy"] = ent.detach()
    metrics["loss/total"] = loss.detach()
    metrics.update(
        token_metrics(
            logp.detach(), rollout_logp=rollout_logp, ratio=ratio_seen, advantages=A, mask=mask,
            is_weight=w_used, is_dropped=dropped, config=cfg, entropy=entropy,
        )
    )
    metrics.update(correction_metrics(masks, extra, mask=mask))
    return loss, metrics


def surrogate(
    logp: torch.Tensor,  # [T] requires grad
    ratio: torch.Tensor,  # [T] pi_theta / pi_old (token or sequence level), requires grad
    advantages: torch.Tensor,  # [T]
    *,
    config: LossConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # [T] per-token loss, named per-token figures for the metrics
    """The per-token policy loss of ``config.pg_loss`` before masks, weights and aggregation."""
    cfg, A = config, advantages
    if cfg.pg_loss == "ppo":
        eps_low, eps_high = cfg.clip_range()
        clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # [T]
        pg = torch.maximum(-A * ratio, -A * clipped)  # [T]
        if cfg.dual_clip_c is not None:
            pg = torch.where(A < 0, torch.minimum(pg, -A * cfg.dual_clip_c), pg)
        return pg, {}
    if cfg.pg_loss == "cispo":
        eps_low, eps_high = cfg.clip_range()
        return corrections.cispo_loss(logp, ratio, A, eps_low=eps_low, eps_high=eps_high), {}
    if cfg.pg_loss == "sapo":
        pg, gate = corrections.sapo_loss(ratio, A, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg)
        return pg, {"sapo/soft_gate": gate}
    if cfg.pg_loss == "dppo":
        return -A * ratio, {}  # the TV mask is one of correction_masks; the KL term is added after the masks
    raise ValueError(f"unknown policy loss {cfg.pg_loss!r}; use ppo, cispo, sapo or dppo")


def correction_masks(
    logp: torch.Tensor,  # [T]
    *,
    rollout_logp: torch.Tensor,  # [T] mu
    prox_logp: torch.Tensor,  # [T] pi_prox
    advantages: torch.Tensor,  # [T]
    mask: torch.Tensor,  # [T] float
    cu_seqlens: torch.Tensor,  # [S+1]
    config: LossConfig,
) -> dict[str, torch.Tensor]:  # name -> [T] bool keep
    """The keep-masks of the corrections ``config`` turns on (:mod:`rollshard.train.corrections`), by name. A mask
    is a constant of the step: no gradient flows through it."""
    cfg, out = config, {}
    if cfg.m2po_tau is not None or cfg.geo_rs is not None or cfg.k3_rs is not None:
        log_w = (prox_logp.detach() - rollout_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [T] log pi_prox / mu
    if cfg.pg_loss == "dppo":
        high, low = corrections.dppo_masks(
            logp, rollout_logp=rollout_logp, advantages=advantages, low=cfg.dppo_mask_low, high=cfg.dppo_mask_high
        )
        out["dppo_high"], out["dppo_low"] = ~high, ~low
    if cfg.opsm_delta is not None:
        out["opsm"] = corrections.opsm_keep(
            logp, rollout_logp=rollout_logp, advantages=advantages, mask=mask, cu_seqlens=cu_seqlens, delta=cfg.opsm_delta
        )
    if cfg.m2po_tau is not None:
        out["m2po"] = corrections.m2po_keep(log_w, mask, tau=cfg.m2po_tau)
    if cfg.geo_rs is not None:
        low, high = cfg.geo_rs
        out["geo_rs"] = corrections.geo_rs_keep(log_w, mask, cu_seqlens, low=low, high=high)
    if cfg.k3_rs is not None:
        out["k3_rs"] = corrections.k3_rs_keep(log_w, mask, cu_seqlens, threshold=cfg.k3_rs, reduce=cfg.k3_rs_reduce)
    return out


def correction_metrics(
    masks: dict[str, torch.Tensor],  # name -> [T] bool keep
    extra: dict[str, torch.Tensor],  # name -> [T] per-token figure of the surrogate
    *,
    mask: torch.Tensor,  # [T] float
) -> dict[str, torch.Tensor]:
    """Each mask's dropped share of the valid tokens (``mask/<name>``), ``mask/any`` for all of them together, and
    the surrogate's per-token figures as mean / min / max (SAPO's gate, as AReaL logs ``sapo_soft_gate``)."""
    on = mask > 0  # [T]
    if not bool(on.any()):
        return {}
    out: dict[str, torch.Tensor] = {}
    if masks:
        for name, keep in masks.items():
            out[f"mask/{name}"] = (~keep[on]).float().mean()
        out["mask/any"] = (~torch.stack([k[on] for k in masks.values()]).all(dim=0)).float().mean()
    for name, values in extra.items():
        v = values[on]
        out[f"{name}_mean"], (out[f"{name}_min"], out[f"{name}_max"]) = v.mean(), torch.aminmax(v)
    return out


def token_metrics(
    logp: torch.Tensor,  # [T]
    *,
    rollout_logp: torch.Tensor,  # [T]
    ratio: torch.Tensor,  # [T] the ratio that was clipped
    advantages: torch.Tensor,  # [T]
    mask: torch.Tensor,  # [T]
    is_weight: torch.Tensor,  # [T]
    is_dropped: torch.Tensor | None,  # [T] bool: weight truncated (TIS) or masked out (MIS); None: none was
    config: LossConfig,
    entropy: torch.Tensor | None = None,  # [T]
) -> dict[str, torch.Tensor]:
    """Mismatch, ratio, clip and importance-weight statistics over the valid tokens. An ``is_weight`` that is
    the ``ratio`` tensor itself (bypass mode) shares the ratio's figures instead of reducing it twice."""
    on = mask > 0  # [T]
    eps_low, eps_high = config.clip_range()
    n = on.sum()
    at = torch.nonzero(on).flatten()  # [K] the valid tokens, found once for every figure below
    if at.numel() == 0:
        return {"tokens": n.float()}
    A, r = advantages.index_select(0, at), ratio.index_select(0, at)  # [K]
    diff = (logp - rollout_logp).index_select(0, at)  # [K] log(pi / pi_rollout)
    r_mean, (r_min, r_max) = r.mean(), torch.aminmax(r)
    if is_weight is ratio:
        w, (w_mean, w_min, w_max) = r, (r_mean, r_min, r_max)
    else:
        w = is_weight.index_select(0, at)  # [K]
        w_mean, (w_min, w_max) = w.mean(), torch.aminmax(w)
    abs_diff = diff.abs()  # [K]
    out = {
        "tokens": n.float(),
        "ratio/mean": r_mean,
        "ratio/min": r_min,
        "ratio/max": r_max,
        "mismatch/abs_diff_mean": abs_diff.mean(),
        "mismatch/abs_diff_max": abs_diff.max(),
        # k3 estimate of KL(pi_rollout || pi) from the rollout's own samples: u - 1 - log u, u = pi / pi_rollout.
        "mismatch/k3_kl": (torch.expm1(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - diff).mean(),
        "is/mean": w_mean,
        "is/sq_mean": (w * w).mean(),
        "is/min": w_min,
        "is/max": w_max,
        "is/frac_dropped": (
            is_dropped.index_select(0, at).float().mean() if is_dropped is not None else r_mean.new_zeros(())
        ),
    }
    if config.pg_loss in ("ppo", "cispo"):  # SAPO and DPPO do not clip
        # CISPO's frac_high is TRL's cispo_clip_ratio: (r > 1 + eps_high) & (A > 0).
        out["clip/frac_low"] = ((A < 0) & (r < 1.0 - eps_low)).float().mean()
        out["clip/frac_high"] = ((A > 0) & (r > 1.0 + eps_high)).float().mean()
    if config.dual_clip_c is not None and config.pg_loss == "ppo":
        out["clip/frac_dual"] = ((A < 0) & (r > config.dual_clip_c)).float().mean()
    if entropy is not None:
        out["entropy/mean"] = entropy.detach().index_select(0, at).mean()
    return out


def effective_sample_size(w_mean: float, w_sq_mean: float) -> float:
    """Normalized ESS of importance weights, ``mean(w)^2 / mean(w^2)`` in (0, 1]; 1 when all weights are equal."""
    return w_mean * w_mean / w_sq_mean if w_sq_mean > 0 else 0.0

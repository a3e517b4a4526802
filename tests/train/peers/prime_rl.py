"""prime-rl's default RL loss (DPPO-Binary-TV mask + Kimi-K2.5 squared-log-ratio KL), transcribed in prime-rl's
own layout and names.

Source: github.com/PrimeIntellect-ai/prime-rl at commit 559b44772e471d1538537b8805cc77f3824a5e64 (2026-08-21).

* ``src/prime_rl/trainer/rl/loss.py``
  - L13-36 ``LossInputs`` / ``LossOutputs``
  - L94-97 ``_safe_mean``, L100-106 ``compute_importance_ratio_and_mismatch_kl``
  - L109-161 ``default_loss_fn``
  - L285-403 ``compute_loss`` (only its rl component here; ce / ref_kl components omitted)
* ``packages/prime-rl-configs/src/prime_rl/configs/trainer.py`` L494-507 ``DefaultLossConfig``
  (``dppo_mask_low=0.2``, ``dppo_mask_high=0.2``, ``adv_tau=1.0``, ``kl_tau=1e-3``); L604 it is the default loss.
* ``src/prime_rl/trainer/rl/train.py`` L301-323 (``rl_scale``: the loss-mask token count summed over all micro-batches
  of the step and all dp*cp ranks, at least 1), L459-474 (``compute_loss`` call), L496-520 (``mismatch_kl/all``),
  L537-539 (the loss metrics go to ``Tensors``)
* ``src/prime_rl/trainer/utils.py`` L238-281 ``Tensors.compute_stats`` (``{key}/mean|median|std|min|max``)

Layout: a micro-batch is packed ``[1, T]``; ``compute_loss`` gets per-sample 1D lists (``.squeeze().split(
sequence_lengths)``) and runs the loss function once per sample. ``trainer_logprobs`` carries the graph;
``inference_logprobs`` (mu, the sampler's logprobs) is data. Advantages are per token.

The one addition to the peer's return values: ``LossOutputs.extras`` (``per_token_loss`` with its graph,
``keep_mask``, ``is_masked``), absent in prime-rl. Imports: torch and stdlib only (prime-rl's jaxtyping / beartype
annotations dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor


@dataclass
class DefaultLossConfig:
    """configs/trainer.py L494-507."""

    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass
class LossInputs:
    """loss.py L13-28 (one sample, 1D ``[seq]``)."""

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor  # bool
    loss_weights: Tensor | None = field(default=None)


@dataclass
class LossOutputs:
    """loss.py L31-36, plus ``extras`` (not in prime-rl)."""

    loss: Tensor
    metrics: dict[str, Tensor]
    extras: dict[str, Tensor] = field(default_factory=dict)


def _safe_mean(values: Tensor, mask: Tensor) -> Tensor:
    """loss.py L94-97: mean over a boolean mask; 0 when the mask is empty."""
    denom = torch.clamp_min(mask.sum(), 1)
    return values[mask].sum() / denom


def compute_importance_ratio_and_mismatch_kl(
    trainer_logprobs: Tensor, inference_logprobs: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """loss.py L100-106. Nothing detached: the ratio's graph is the policy gradient's."""
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    mismatch_kl = importance_ratio - log_importance_ratio - 1
    return log_importance_ratio, importance_ratio, mismatch_kl


def default_loss_fn(inputs: LossInputs, loss_config: DefaultLossConfig) -> LossOutputs:
    """loss.py L109-161. Per token, with ``p = exp(trainer_logprobs)``, ``mu = exp(inference_logprobs)``,
    ``r = p / mu`` (graph through ``trainer_logprobs``, no detach, no clip, no truncation):

    * drop where ``A > 0`` and ``p - mu > dppo_mask_high``, or where ``A <= 0`` and ``p - mu < -dppo_mask_low``
      (strict comparisons, probabilities not logs; ``A == 0`` takes the low branch);
    * ``per_token_loss = -(keep * adv_tau * A * r) + kl_tau * loss_mask * (log r)^2`` (the KL term on every
      ``loss_mask`` token, masked or not), times ``loss_weights`` if given;
    * ``loss = per_token_loss.sum()`` over the sample (``compute_loss`` divides by the global token count).
    """
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    advantages = inputs.advantages
    loss_mask = inputs.loss_mask

    log_importance_ratio, importance_ratio, mismatch_kl = compute_importance_ratio_and_mismatch_kl(
        trainer_logprobs, inference_logprobs
    )

    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    dppo_invalid_mask_high = probs_diff > loss_config.dppo_mask_high
    dppo_invalid_mask_low = probs_diff < -loss_config.dppo_mask_low
    positive_advantages = advantages > 0
    negative_advantages = advantages < 0
    dppo_invalid_mask = torch.where(positive_advantages, dppo_invalid_mask_high, dppo_invalid_mask_low)

    is_masked = dppo_invalid_mask
    is_masked_high = positive_advantages & dppo_invalid_mask_high
    is_masked_low = negative_advantages & dppo_invalid_mask_low
    drop_mask = loss_mask & is_masked
    keep_mask = loss_mask & ~is_masked

    advantages = loss_config.adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + loss_config.kl_tau * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    loss = per_token_loss.sum()

    metrics = {
        "masked_mismatch_kl": _safe_mean(mismatch_kl, loss_mask & is_masked),
        "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),
        "is_masked": _safe_mean(is_masked, loss_mask),
        "is_masked_low": _safe_mean(is_masked_low, loss_mask),
        "is_masked_high": _safe_mean(is_masked_high, loss_mask),
        "masked_advantage_positive": _safe_mean(positive_advantages, drop_mask),
        "masked_advantage_negative": _safe_mean(negative_advantages, drop_mask),
    }
    extras = {"per_token_loss": per_token_loss, "keep_mask": keep_mask, "is_masked": is_masked}
    return LossOutputs(loss=loss, metrics=metrics, extras=extras)


def setup_rl_loss_fn(loss_config: DefaultLossConfig) -> Callable[[LossInputs], LossOutputs]:
    """loss.py L262-282, the default branch."""

    def rl_fn(inputs: LossInputs) -> LossOutputs:
        return default_loss_fn(inputs, loss_config)

    return rl_fn


def compute_loss(
    trainer_logprobs: list[Tensor],
    inference_logprobs: list[Tensor],
    ref_logprobs: list[Tensor] | None,
    advantages: list[Tensor],
    loss_mask: list[Tensor],
    rl_weights: list[Tensor] | None,
    rl_loss_fn: Callable[[LossInputs], LossOutputs],
    rl_scale: int,
) -> tuple[Tensor, dict[str, Any]]:
    """loss.py L285-403, the rl component only (``ce_weights`` / ``ref_kl_weights`` None): the sum of the
    per-sample losses over ``rl_scale`` (the step's global loss-token count, train.py L301-323), and each metric
    stacked to one value per sample (per-sample means, which ``Tensors.compute_stats`` then averages over samples)."""
    all_metrics: dict[str, list[Tensor]] = {}
    n = len(trainer_logprobs)
    if ref_logprobs is None:
        ref_logprobs = [None] * n
    if rl_weights is None:
        rl_weights = [None] * n

    def run_loss_fn(loss_fn, inputs: LossInputs) -> Tensor:
        result = loss_fn(inputs)
        for k, v in result.metrics.items():
            all_metrics.setdefault(k, []).append(v)
        return result.loss

    rl_loss = trainer_logprobs[0].sum() * 0.0
    for t_logp, i_logp, ref_logp, adv, mask, rl_w in zip(
        trainer_logprobs, inference_logprobs, ref_logprobs, advantages, loss_mask, rl_weights
    ):

        def make_inputs(component_mask: Tensor, weights: Tensor | None) -> LossInputs:
            return LossInputs(
                trainer_logprobs=t_logp,
                inference_logprobs=i_logp,
                ref_logprobs=ref_logp,
                advantages=adv,
                loss_mask=component_mask,
                loss_weights=weights,
            )

        if rl_w is None:
            rl_loss = rl_loss + run_loss_fn(rl_loss_fn, make_inputs(mask, None))
        else:
            rl_mask = mask & (rl_w != 0)
            if bool(rl_mask.any()):
                rl_loss = rl_loss + run_loss_fn(rl_loss_fn, make_inputs(rl_mask, rl_w))

    scaled_loss = rl_loss / rl_scale

    aggregated: dict[str, Any] = {}
    for k, v in all_metrics.items():
        aggregated[k] = torch.stack(v) if v[0].dim() == 0 else torch.cat(v)
    return scaled_loss, aggregated


def mismatch_kl_all(trainer_logprobs: Tensor, inference_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """train.py L496-512 (no rl/ref_kl weight streams): the token-level ``mismatch_kl/all`` values,
    ``r - log r - 1`` on every ``loss_mask`` token (one value per token, unlike the per-sample loss metrics)."""
    with torch.no_grad():
        _, _, mismatch_kl = compute_importance_ratio_and_mismatch_kl(trainer_logprobs, inference_logprobs)
    return mismatch_kl[loss_mask].detach()


def compute_stats(tensors: dict[str, list[Tensor]]) -> dict[str, float]:
    """utils.py L245-281 on one rank: per key, the concatenated 1D values' ``/mean``, ``/median`` (torch's: the
    lower middle value), ``/std`` (unbiased), ``/min``, ``/max``; NaN for all five when empty."""
    metrics: dict[str, float] = {}
    for key in sorted(tensors):
        values = tensors[key]
        t = torch.cat(values, dim=0) if values else torch.empty(0)
        if t.numel() == 0:
            for s in ("mean", "median", "std", "min", "max"):
                metrics[f"{key}/{s}"] = float("nan")
            continue
        metrics[f"{key}/mean"] = t.mean().item()
        metrics[f"{key}/median"] = torch.median(t).item()
        metrics[f"{key}/std"] = t.std().item()
        metrics[f"{key}/min"] = t.min().item()
        metrics[f"{key}/max"] = t.max().item()
    return metrics

"""AReaL's actor loss path, transcribed: M2PO masking, the PPO actor loss (decoupled, with token-level rejection
sampling) and the SAPO loss, in AReaL's own layout and names.

Source: github.com/inclusionAI/AReaL at commit 4aef98d8d818af55b43621aaadba047ae10f4e77 (2026-05-21).

* ``areal/trainer/ppo/actor.py``
  - L408-596 ``grpo_loss_fn``: M2PO mask (L446-448), then SAPO (L451-466) or PPO (L467-480), stats (L514-573)
  - L769-810 ``_apply_m2po_masking``, L813-850 ``_get_m2po_loss_mask``
  - L363 ``loss_weight_fn=lambda x: x["loss_mask"].count_nonzero()``
* ``areal/utils/functional/functional.py``
  - L56-149 ``_compute_sequence_level_ratio_and_advantages`` (GSPO / sequence-level SAPO)
  - L167-182 ``_check_bounds``, L185-426 ``apply_rejection_sampling`` (only level="token", metric="ratio" here)
  - L429-559 ``ppo_actor_loss_fn``, L562-638 ``sapo_loss_fn``
* ``areal/engine/fsdp_engine.py`` L1977-2046 ``_compute_logprobs_and_loss`` (per-micro-batch loss scale, L2045-2046)
* ``areal/utils/stats_tracker.py`` L96-300 (how ``stat`` / ``denominator`` are reduced on export)
* defaults: ``areal/api/cli_args.py`` L1396-1414 (eps_clip=0.2, eps_clip_higher=None, c_clip=None,
  m2_threshold=None), L1465-1476 (use_sapo_loss=False, sapo_tau_pos=1.0, sapo_tau_neg=1.05), L1479-1490
  (recompute_logprob=False, use_decoupled_loss=False), RejectionSamplingConfig L1224-1385 (level="token",
  action="mask", metric="ratio", agg="mean", upper=5.0, lower=None)

Layout: the engine calls ``grpo_loss_fn`` once per engine micro-batch with **packed 1D** tensors ``[T]`` (all
sequences of the micro-batch concatenated, ``cu_seqlens`` ``[B+1]``); every function here also accepts AReaL's
padded 2D ``[B, L]`` form, as the originals do. ``logprobs`` / ``old_logp`` / ``loss_mask`` at position ``t`` are
already rolled so that position ``t`` scores token ``t+1`` (``actor.py`` L175-196).
Names: ``old_logp`` / ``old_logprobs`` is the behaviour (inference) policy; ``prox_logp`` / ``proximal_logprobs``
the proximal policy (recomputed before the update); ``logprobs`` the current policy (the only input with a graph).

The one addition to the peer's return values: the loss functions' ``stat`` dict carries ``"_per_token_loss"``, the
per-token loss *with* its graph before masking and aggregation (AReaL keeps only the detached copy ``stat["loss"]``).
Imports: torch and stdlib only.
"""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------------------------------------
# M2PO (actor.py L769-850)
# ----------------------------------------------------------------------------------------------------------------


def _apply_m2po_masking(
    old_logp: torch.Tensor,
    prox_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    m2_threshold: float,
) -> torch.Tensor:
    """actor.py L769-810. ``m2 = (old_logp - prox_logp)^2`` (behaviour vs proximal; the live ``logprobs`` is not
    used), over all ``loss_mask`` tokens of the micro-batch together (not per sequence). Returns a bool mask."""
    delta = old_logp - prox_logp
    m2 = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = m2.view(-1)[mask_flat]

    if m2_selected.numel() == 0:
        return loss_mask

    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    sorted_m2_loss_mask = _get_m2po_loss_mask(sorted_m2=sorted_m2, m2_threshold=m2_threshold)
    m2_selected_mask = sorted_m2_loss_mask[restored_indices]

    m2_full_flat = torch.zeros_like(mask_flat, dtype=torch.bool, device=loss_mask.device)
    m2_full_flat[mask_flat] = m2_selected_mask

    return m2_full_flat.view_as(loss_mask)


def _get_m2po_loss_mask(
    sorted_m2: torch.Tensor,
    m2_threshold: float,
) -> torch.Tensor:
    """actor.py L813-850. Vectorized: mask the ``k`` largest, ``k`` the first index whose suffix mean
    ``mean(sorted_m2[k:])`` is strictly ``< m2_threshold``; if none is, keep only the smallest one."""
    n = sorted_m2.numel()
    if n == 0:
        return torch.ones_like(sorted_m2, dtype=torch.bool)

    # Suffix sums: S[i] = sum(sorted_m2[i:])
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)

    # Number of elements in suffix: N[i] = n - i
    counts = torch.arange(n, 0, -1, device=sorted_m2.device, dtype=sorted_m2.dtype)

    # Average of suffix: A[i] = S[i] / N[i]
    avg_m2_suffix = suffix_sums / counts

    # Find the first index `k` where the average of the rest is below threshold.
    below_threshold_indices = torch.where(avg_m2_suffix < m2_threshold)[0]

    if len(below_threshold_indices) > 0:
        num_to_mask = below_threshold_indices[0].item()
    else:
        # All suffix averages are >= threshold. Mask all but one to satisfy assertion.
        num_to_mask = n - 1

    loss_mask = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        loss_mask[:num_to_mask] = False

    if loss_mask.sum() == 0:
        raise RuntimeError("All tokens are masked out when getting the m2po loss mask.")

    return loss_mask


# ----------------------------------------------------------------------------------------------------------------
# functional.py
# ----------------------------------------------------------------------------------------------------------------


def _compute_sequence_level_ratio_and_advantages(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """functional.py L56-149: per-sequence geometric-mean ratio and mean advantage, broadcast to the tokens."""
    if log_ratio.ndim == 1:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required for 1D tensors (packed format).")
        batch_size = cu_seqlens.shape[0] - 1
        seq_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        sequence_idx = torch.arange(batch_size, device=log_ratio.device).repeat_interleave(seq_lengths)

        masked_log_ratio = torch.where(loss_mask, log_ratio, 0.0)
        log_ratio_sum_per_seq = torch.zeros(batch_size, device=log_ratio.device, dtype=log_ratio.dtype).scatter_add_(
            0, sequence_idx, masked_log_ratio
        )
        masked_advantages = torch.where(loss_mask, advantages, 0.0)
        advantages_sum_per_seq = torch.zeros(
            batch_size, device=advantages.device, dtype=advantages.dtype
        ).scatter_add_(0, sequence_idx, masked_advantages)
        valid_count_per_seq = (
            torch.zeros(batch_size, device=loss_mask.device, dtype=torch.int32)
            .scatter_add_(0, sequence_idx, loss_mask.int())
            .clamp(min=1)
        )
        log_ratio_mean_per_seq = log_ratio_sum_per_seq / valid_count_per_seq.to(log_ratio.dtype)
        adv_mean_per_seq = advantages_sum_per_seq / valid_count_per_seq.to(advantages.dtype)

        ratio = torch.exp(log_ratio_mean_per_seq)[sequence_idx]
        ratio = torch.where(loss_mask, ratio, 0.0)
        advantages = adv_mean_per_seq[sequence_idx]
        advantages = torch.where(loss_mask, advantages, 0.0)
    else:
        seq_log_ratio_mean = torch.where(loss_mask, log_ratio, 0.0).sum(dim=1) / (loss_mask.sum(dim=1).clamp(min=1))
        ratio = torch.exp(seq_log_ratio_mean.unsqueeze(1).expand_as(log_ratio))
        ratio = torch.where(loss_mask, ratio, 0.0)
        seq_lengths = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
        masked_advantages = torch.where(loss_mask, advantages, 0.0)
        advantages = (masked_advantages.sum(dim=-1, keepdim=True) / seq_lengths).expand_as(log_ratio)
        advantages = torch.where(loss_mask, advantages, 0.0)

    return ratio, advantages


def _check_bounds(metric: torch.Tensor, config) -> torch.Tensor:
    """functional.py L167-182."""
    if config.lower is not None:
        return (metric >= config.lower) & (metric <= config.upper)
    else:
        return metric <= config.upper


def apply_rejection_sampling(
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    config,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """functional.py L185-426, the ``level="token"``, ``metric="ratio"`` path only (others raise).
    ``config``: any object with ``level``, ``action`` ("mask" | "clamp"), ``metric``, ``upper``, ``lower``
    (AReaL's ``RejectionSamplingConfig``; its ``__post_init__`` sets ``lower=0.0`` for clamp when unset).
    Returns ``(loss_mask, behave_imp_weight, filtered_fraction)`` (AReaL's ``RejectionSamplingResult``)."""
    if config.level != "token" or config.metric != "ratio":
        raise NotImplementedError("transcribed for level='token', metric='ratio' only")
    log_ratio = proximal_logprobs.detach().float() - old_logprobs.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    metric = torch.exp(log_ratio)
    behave_imp_weight = torch.exp(log_ratio)
    original_weight = behave_imp_weight

    if config.action == "mask":
        in_bounds = _check_bounds(metric, config)
    else:
        behave_imp_weight = behave_imp_weight.clamp(
            min=config.lower if config.lower is not None else 0.0,
            max=config.upper,
        )

    if config.action == "mask":
        candidates = loss_mask.bool()
        updated_mask = (candidates & in_bounds).to(loss_mask.dtype)
        filtered_count = (candidates & ~in_bounds).sum().item()
        total_count = candidates.sum().item()
        filtered_fraction = filtered_count / max(total_count, 1)
    else:
        updated_mask = loss_mask
        clamped_count = (loss_mask.bool() & (original_weight != behave_imp_weight)).sum().item()
        total_count = loss_mask.bool().sum().item()
        filtered_fraction = clamped_count / max(total_count, 1)

    behave_imp_weight = torch.where(updated_mask.bool(), behave_imp_weight, 0.0)
    return updated_mask, behave_imp_weight, filtered_fraction


def ppo_actor_loss_fn(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling=None,
    importance_sampling_level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """functional.py L429-559. ``ratio = pi_theta / pi_prox`` (graph through ``logprobs``),
    ``L = max(-A r, -A clip(r, 1-eps_clip, 1+(eps_clip_higher or eps_clip)))`` (``torch.max`` of two tensors: a tie
    sends half the gradient to each side), dual clip ``min(L, sign(A) c_clip A)``, times the constant
    ``behave_imp_weight = pi_prox / pi_behave`` when rejection sampling is set; returns
    ``sum(where(loss_mask, L, 0)) / loss_mask_count`` with ``loss_mask_count`` counted *before* rejection sampling
    (but after M2PO, which the caller applied)."""
    loss_mask_count = loss_mask.count_nonzero() or 1

    if rejection_sampling is not None:
        loss_mask, behave_imp_weight, filtered_fraction = apply_rejection_sampling(
            proximal_logprobs=proximal_logprobs,
            old_logprobs=old_logprobs,
            loss_mask=loss_mask,
            cu_seqlens=cu_seqlens,
            config=rejection_sampling,
        )
    else:
        filtered_fraction = 0.0

    if importance_sampling_level == "sequence":
        log_ratio = logprobs - proximal_logprobs
        ratio, advantages = _compute_sequence_level_ratio_and_advantages(log_ratio, advantages, loss_mask, cu_seqlens)
    elif importance_sampling_level == "token":
        ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    else:
        raise ValueError(f"Invalid importance_sampling_level: {importance_sampling_level}.")

    clipped_ratio = torch.clamp(
        ratio,
        1.0 - eps_clip,
        1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher),
    )

    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    clip_mask = pg_loss1.detach() < pg_loss2.detach()
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if c_clip is not None:
        assert c_clip > 1.0, c_clip
        pg_loss3 = torch.sign(advantages) * c_clip * advantages
        dual_clip_mask = pg_loss3.detach() < pg_loss.detach()
        pg_loss = torch.min(pg_loss, pg_loss3)
    else:
        dual_clip_mask = torch.zeros_like(clip_mask)

    if rejection_sampling is not None:
        behave_approx_kl = proximal_logprobs.detach() - old_logprobs.detach()
        behave_mask = (behave_imp_weight > 0).logical_and(loss_mask.bool())
        behave_approx_kl = torch.where(behave_mask, behave_approx_kl, 0.0)
        pg_loss = pg_loss * behave_imp_weight

    per_token_loss = pg_loss
    logging_loss = pg_loss.detach()
    pg_loss = torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count
    clip_mask.logical_and_(loss_mask)
    dual_clip_mask.logical_and_(loss_mask)
    stat = dict(
        loss=logging_loss,
        importance_weight=ratio.detach(),
        approx_kl=(logprobs - proximal_logprobs).detach(),
        clip_mask=clip_mask,
        dual_clip_mask=dual_clip_mask,
        _per_token_loss=per_token_loss,  # not in AReaL: the per-token loss with its graph
    )
    if rejection_sampling is not None:
        stat.update(
            behave_approx_kl=behave_approx_kl.detach(),
            behave_imp_weight=behave_imp_weight.detach(),
            behave_mask=behave_mask,
            filtered_fraction=filtered_fraction,
        )
    return pg_loss, stat


def sapo_loss_fn(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
    loss_mask: torch.Tensor,
    importance_sampling_level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """functional.py L562-638. ``r = exp(logprobs - old_logprobs)`` (``old_logprobs`` is the behaviour logprob, or
    the recomputed one with ``recompute_logprob``; no proximal policy: SAPO refuses ``use_decoupled_loss``),
    ``L = -(4/tau) * sigmoid(tau (r - 1)) * A`` with ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``; no clip,
    no mask of its own; token-mean over ``loss_mask``."""
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError("SAPO temperatures (tau_pos, tau_neg) must be positive.")
    loss_mask_count = loss_mask.count_nonzero() or 1
    advantages = advantages.detach()
    log_ratio = logprobs - old_logprobs

    if importance_sampling_level == "sequence":
        ratio, advantages = _compute_sequence_level_ratio_and_advantages(log_ratio, advantages, loss_mask, cu_seqlens)
    elif importance_sampling_level == "token":
        ratio = torch.exp(log_ratio)
    else:
        raise ValueError(f"Invalid importance_sampling_level: {importance_sampling_level}.")

    # SAPO: Asymmetric sigmoid gates with 4/tau gradient normalization
    gate_pos = torch.sigmoid(tau_pos * (ratio - 1.0))
    gate_neg = torch.sigmoid(tau_neg * (ratio - 1.0))
    scale_pos = 4.0 / tau_pos
    scale_neg = 4.0 / tau_neg
    scaled_gate_pos = gate_pos * scale_pos
    scaled_gate_neg = gate_neg * scale_neg

    is_positive = advantages > 0
    soft_gate = torch.where(is_positive, scaled_gate_pos, scaled_gate_neg)

    pg_loss = -soft_gate * advantages
    per_token_loss = pg_loss
    logging_loss = pg_loss.detach()
    pg_loss = torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count

    stat = dict(
        loss=logging_loss,
        importance_weight=ratio.detach(),
        approx_kl=log_ratio.detach(),
        clip_mask=torch.zeros_like(loss_mask, dtype=torch.bool),
        dual_clip_mask=torch.zeros_like(loss_mask, dtype=torch.bool),
        sapo_soft_gate=soft_gate.detach(),
        sapo_scaled_gate_pos=scaled_gate_pos.detach(),
        sapo_scaled_gate_neg=scaled_gate_neg.detach(),
        _per_token_loss=per_token_loss,  # not in AReaL: the per-token loss with its graph
    )
    return pg_loss, stat


# ----------------------------------------------------------------------------------------------------------------
# actor.py grpo_loss_fn (L408-596): the part that joins M2PO and the losses, and the stats it records
# ----------------------------------------------------------------------------------------------------------------


def grpo_loss_fn(
    logprobs: torch.Tensor,
    input_data: dict,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling=None,
    m2_threshold: float | None = None,
    importance_sampling_level: str = "token",
    use_sapo_loss: bool = False,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    use_decoupled_loss: bool = False,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict, dict]:
    """actor.py L408-596 with ``prox_logp_method="recompute"`` (``prox_logp = input_data["prox_logp"]``), no
    teacher/distillation term, no version or proximal-approximation metrics. ``input_data`` keys as AReaL's:
    ``logprobs`` (behaviour), ``prox_logp``, ``advantages``, ``loss_mask``, optional ``cu_seqlens``.

    Returns ``(loss, denominators, stats)``: the micro-batch loss (before the engine's scale, see
    :func:`fsdp_micro_batch_loss_scale`) and what ``stats_tracker`` records under scope ``ppo_actor/update``:
    ``denominators`` name -> bool mask (exported as sums), ``stats`` name -> ``(float tensor, denominator name)``
    (exported as ``name/avg``, ``/min``, ``/max`` over the denominator's tokens) or a python float (a scalar).
    ``n_valid_tokens`` is the loss mask *after* M2PO (and before rejection sampling): the only trace M2PO leaves."""
    old_logp = input_data["logprobs"]
    advantages = input_data["advantages"]
    loss_mask = input_data["loss_mask"].bool()
    prox_logp = input_data.get("prox_logp")
    if prox_logp is None:
        raise ValueError("transcribed for prox_logp_method='recompute': input_data['prox_logp'] is required")

    if m2_threshold is not None:
        loss_mask = _apply_m2po_masking(old_logp, prox_logp, loss_mask, m2_threshold)

    if use_sapo_loss:
        if use_decoupled_loss:
            raise ValueError("SAPO is not compatible with `use_decoupled_loss=True`.")
        loss, stat = sapo_loss_fn(
            logprobs=logprobs,
            old_logprobs=old_logp,
            advantages=advantages,
            tau_pos=sapo_tau_pos,
            tau_neg=sapo_tau_neg,
            loss_mask=loss_mask,
            importance_sampling_level=importance_sampling_level,
            cu_seqlens=input_data.get("cu_seqlens"),
        )
    else:
        loss, stat = ppo_actor_loss_fn(
            logprobs=logprobs,
            old_logprobs=old_logp,
            advantages=advantages,
            eps_clip=eps_clip,
            eps_clip_higher=eps_clip_higher,
            loss_mask=loss_mask,
            c_clip=c_clip,
            proximal_logprobs=prox_logp,
            rejection_sampling=rejection_sampling,
            importance_sampling_level=importance_sampling_level,
            cu_seqlens=input_data.get("cu_seqlens"),
        )

    denominators = dict(
        n_valid_tokens=loss_mask.bool(),
        clipped_tokens=stat["clip_mask"],
        dual_clipped_tokens=stat["dual_clip_mask"],
    )
    stats: dict = dict(
        importance_weight=(stat["importance_weight"], "n_valid_tokens"),
        approx_kl=(stat["approx_kl"], "n_valid_tokens"),
        new_logp=(logprobs.detach(), "n_valid_tokens"),
        old_logp=(old_logp, "n_valid_tokens"),
        actor_loss=(stat["loss"], "n_valid_tokens"),
        clip_ratio=(stat["clip_mask"].float(), "n_valid_tokens"),
        dual_clip_ratio=(stat["dual_clip_mask"].float(), "n_valid_tokens"),
    )
    if entropy is not None:
        stats["entropy"] = (entropy.detach().float(), "n_valid_tokens")
    if "behave_imp_weight" in stat:
        denominators["unclipped_behave_tokens"] = stat["behave_mask"]
        stats["behave_imp_weight"] = (stat["behave_imp_weight"], "unclipped_behave_tokens")
        stats["behave_approx_kl"] = (stat["behave_approx_kl"], "unclipped_behave_tokens")
    if "filtered_fraction" in stat:
        stats["rs_filtered_fraction"] = float(stat["filtered_fraction"])
    if use_sapo_loss:
        for key in ("sapo_soft_gate", "sapo_scaled_gate_pos", "sapo_scaled_gate_neg"):
            stats[key] = (stat[key], "n_valid_tokens")
    else:
        clip_mask = stat["clip_mask"]
        stats["clipped_new_logp"] = (torch.where(clip_mask, logprobs.detach(), 0.0), "clipped_tokens")
        stats["clipped_old_logp"] = (torch.where(clip_mask, old_logp, 0.0), "clipped_tokens")
    return loss, denominators, stats


def fsdp_micro_batch_loss_scale(
    mb_input: dict, total_loss_weight: torch.Tensor | float, loss_multiplier: float = 1.0
) -> torch.Tensor:
    """fsdp_engine.py L1987, L2045-2046 with actor.py L363: the engine multiplies the micro-batch loss by
    ``local_weight / total_loss_weight * dp_size``, ``local_weight = mb_input["loss_mask"].count_nonzero()`` (the
    *original* mask, before M2PO and rejection sampling), ``total_loss_weight`` its sum over all micro-batches and
    data-parallel ranks of the step; FSDP then averages gradients over the ``dp_size`` ranks."""
    local_weight = mb_input["loss_mask"].count_nonzero()
    return local_weight / total_loss_weight * loss_multiplier


def export_stats(denominators: dict, stats: dict) -> dict[str, float]:
    """stats_tracker.py L186-300 for one micro-batch on one rank (keys without the ``ppo_actor/update/`` scope):
    a denominator is its count; a tensor stat gives ``/avg`` (sum over the denominator's tokens / their count),
    ``/min``, ``/max`` (omitted when the denominator is empty); a scalar is its value."""
    out: dict[str, float] = {k: float(d.sum()) for k, d in denominators.items()}
    for key, value in stats.items():
        if isinstance(value, float):
            out[key] = value
            continue
        v, den = value
        d = denominators[den]
        if d.sum() == 0:
            continue
        out[f"{key}/avg"] = float(torch.where(d, v, 0.0).sum() / d.sum())
        out[f"{key}/min"] = float(torch.where(d, v, float("inf")).min())
        out[f"{key}/max"] = float(torch.where(d, v, -float("inf")).max())
    return out

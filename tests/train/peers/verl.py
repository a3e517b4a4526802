"""verl's rollout-correction rejection sampling (Geo-RS, K3-RS and the other k1/k2/k3 options) and its CISPO and
SAPO policy losses, transcribed.

Source: github.com/volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29).

* ``verl/trainer/ppo/rollout_corr_helper.py``
  - L75 ``SAFETY_BOUND = 20.0``; L77-90 the supported ``rollout_rs`` options
  - L93-153 ``_parse_rollout_rs_thresholds``; L156-372 ``compute_rollout_rejection_mask``
  - L375-478 ``compute_rs_metrics``; L716-831 ``compute_rollout_correction_and_rejection_mask``
  - L834-940 ``compute_offpolicy_metrics``
* ``verl/trainer/config/algorithm.py`` L59-564 ``RolloutCorrectionConfig``: Geo-RS presets use
  ``rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"``; K3-RS presets ``rollout_rs="seq_mean_k3",
  rollout_rs_threshold=0.01``.
* ``verl/trainer/ppo/core_algos.py`` L1025-1080 ``agg_loss``; L1329-1411 ``compute_policy_loss_sapo``;
  L1721-1779 ``compute_policy_loss_cispo``; L1841-1902 ``kl_penalty`` / ``kl_penalty_forward``;
  L2064-2200 ``compute_policy_loss_bypass_mode`` (RS against the *current* policy).
* ``verl/utils/torch_functional.py`` L266-301 ``masked_sum`` / ``masked_mean``.
* ``legacy_geometric_rejection_mask``: the older ``rollout_rs="geometric"`` / ``rollout_rs_threshold_lower`` API
  (commit 518bada2, 2025-12-15), kept only to show that its ratio orientation is the inverse of ``seq_mean_k1``'s.

Layout: verl's padded ``[B, L]`` response tensors, ``response_mask`` 1 on response tokens and 0 on padding.

Which ratio: the decoupled trainer (``ray_trainer.py`` L1566-1578, before ``compute_advantage``) calls the RS with
``old_log_prob`` = pi_old (recomputed by the actor) and ``rollout_log_prob`` = the inference engine's log-probs, so
``log_ratio = log(pi_old / pi_rollout)``. In bypass mode (``core_algos.py`` L2147-2159) the same function runs
under ``torch.no_grad()`` inside the loss with ``old_log_prob=log_prob`` (current pi_theta), per micro-batch.
Rejection is ``response_mask * keep_mask``: the returned mask replaces ``batch["response_mask"]`` (so it is the loss
mask, and with the decoupled trainer also the mask the advantage estimator sees). Nothing in it carries a gradient.

Deliberate differences from verl, none changing a value or a gradient: config objects are replaced by keyword
arguments with verl's field names and defaults (``ActorConfig`` / ``RolloutCorrectionConfig``); the IS-weight half
of ``compute_rollout_correction_and_rejection_mask`` (``rollout_is``) is left out, so its first return value is
always ``None``; the two loss functions also return ``pg_losses`` (the per-token loss with its graph, before
aggregation), which verl keeps local. Imports: torch and stdlib only.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"

SAFETY_BOUND = 20.0  # rollout_corr_helper.py L75

SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = {  # rollout_corr_helper.py L77-89
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
}  # fmt: skip
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {"token_k1", "token_k2", "token_k3"}  # L90

# RolloutCorrectionConfig preset defaults (algorithm.py L234-255, L478-502)
GEO_RS_THRESHOLD = "0.999_1.001"  # decoupled_geo_rs / bypass_*_geo_rs*: rollout_rs="seq_mean_k1"
K3_RS_THRESHOLD = 0.01  # decoupled_k3_rs / bypass_ppo_clip_k3_rs: rollout_rs="seq_mean_k3"


# ----------------------------------------------------------------------------------------------------------------
# verl.utils.torch_functional (L266-301)
# ----------------------------------------------------------------------------------------------------------------


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """verl/utils/torch_functional.py L266-284 (verl @ b178a3cd)."""
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    """verl/utils/torch_functional.py L287-301 (verl @ b178a3cd). Note the ``+ 1e-8`` in the denominator."""
    s = masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


# ----------------------------------------------------------------------------------------------------------------
# Rejection sampling (rollout_corr_helper.py L93-478)
# ----------------------------------------------------------------------------------------------------------------


def _parse_rollout_rs_thresholds(
    options: list[str], threshold_spec: Optional[str | float]
) -> dict[str, dict[str, Optional[float]]]:
    """verl/trainer/ppo/rollout_corr_helper.py L93-153 (verl @ b178a3cd).

    One spec per option, comma separated (a single spec is broadcast). ``*k1``: ``"lower_upper"`` ratio bounds, or
    one number = upper with lower = 1/upper. k2/k3: one positive upper bound."""
    if threshold_spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if isinstance(threshold_spec, int | float):
        raw_specs: list[str] = [str(threshold_spec)]
    elif isinstance(threshold_spec, str):
        raw_specs = [part.strip() for part in threshold_spec.split(",") if part.strip()]
    else:
        raise TypeError("rollout_rs_threshold must be a string or numeric value specifying per-option thresholds.")
    if not raw_specs:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value.")
    if len(raw_specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold expects either one threshold shared by all options or exactly "
            f"{len(options)} thresholds to match the provided rollout_rs options."
        )
    if len(raw_specs) == 1 and len(options) > 1:
        raw_specs = raw_specs * len(options)

    thresholds: dict[str, dict[str, Optional[float]]] = {}
    for option, spec in zip(options, raw_specs, strict=False):
        if option.endswith("k1"):
            if "_" in spec:
                lower_str, upper_str = spec.split("_", 1)
            else:
                upper_str = spec
                lower_str = str(1.0 / float(upper_str))
            lower, upper = float(lower_str), float(upper_str)
            if lower <= 0 or upper <= 0:
                raise ValueError(f"Thresholds for option '{option}' must be positive, got {spec}.")
            thresholds[option] = {"lower": lower, "upper": upper}
        else:
            if "_" in spec:
                raise ValueError(f"rollout_rs_threshold for option '{option}' must provide a single upper bound.")
            upper = float(spec)
            if upper <= 0:
                raise ValueError(f"Threshold for option '{option}' must be positive, got {spec}.")
            thresholds[option] = {"lower": None, "upper": upper}
    return thresholds


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: Optional[str | float] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl/trainer/ppo/rollout_corr_helper.py L156-372 (verl @ b178a3cd).

    ``log_ratio`` = log(pi_old / pi_rollout) (bypass mode: log(pi_theta / pi_rollout)), ``[B, L]``.
    Per token, on ``lr = clamp(log_ratio, -20, 20)``: ``k1 = -lr``, ``k2 = 0.5 lr^2``, ``k3 = exp(lr) - 1 - lr``.
    ``seq_sum_*`` / ``seq_mean_*`` / ``seq_max_*`` reduce over ``response_mask`` (masked_mean divides by n + 1e-8).
    k1 keeps ``log(lower) <= stat <= log(upper)``; k2/k3 keep ``stat <= upper``. Sequence options broadcast the keep
    bit to every position. Options are ANDed. Geo-RS = ``seq_mean_k1``; K3-RS = ``seq_mean_k3`` (or ``seq_sum_k3``).
    Returns ``(response_mask * keep).to(response_mask.dtype)`` and metrics (no ``rollout_corr/`` prefix yet)."""
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if log_ratio.shape[0] == 0:
        return response_mask, {}

    option_modes = [opt.strip() for opt in rollout_rs.split(",") if opt.strip()]
    if not option_modes:
        raise ValueError("rollout_rs must contain at least one valid option.")
    normalized_options: list[str] = []
    for opt in option_modes:
        if opt not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"Invalid rollout_rs option: {opt}. Must be one of {sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}."
            )
        if opt not in normalized_options:
            normalized_options.append(opt)
    threshold_specs = _parse_rollout_rs_thresholds(normalized_options, rollout_rs_threshold)

    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    token_k1 = -log_ratio_safe
    token_k2 = 0.5 * log_ratio_safe**2
    token_k3 = torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe
    token_stats = {"k1": token_k1, "k2": token_k2, "k3": token_k3}

    response_mask_bool = response_mask.bool()
    seq_valid_mask = response_mask.sum(dim=-1) > 0
    combined_mask = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}

    def _sequence_max(values: torch.Tensor) -> torch.Tensor:  # L238-243
        neg_inf = torch.tensor(float("-inf"), device=values.device, dtype=values.dtype)
        max_values = values.masked_fill(~response_mask.bool(), neg_inf).max(dim=-1).values
        return torch.where(max_values == neg_inf, torch.zeros_like(max_values), max_values)

    for option_name in normalized_options:
        upper_value = threshold_specs[option_name]["upper"]
        lower_value = threshold_specs[option_name]["lower"]
        is_k1_option = option_name.endswith("k1")
        apply_lower_threshold = is_k1_option
        lower_log = math.log(lower_value) if is_k1_option else None
        upper_log = math.log(upper_value) if is_k1_option else None
        level = "sequence" if option_name not in TOKEN_LEVEL_ROLLOUT_RS_OPTIONS else "token"
        per_sequence_stat: Optional[torch.Tensor] = None
        token_values = token_stats[option_name[-2:]]

        if level == "token":  # L271-281
            per_token_stat = token_values
            if is_k1_option:
                token_keep_bool = (per_token_stat >= lower_log) & (per_token_stat <= upper_log)
            else:
                token_keep_bool = per_token_stat <= upper_value
        else:  # L282-331
            if option_name.startswith("seq_sum"):
                seq_stat = masked_sum(token_values, response_mask, axis=-1)
            elif option_name.startswith("seq_mean"):
                seq_stat = masked_mean(token_values, response_mask, axis=-1)
            else:  # seq_max
                seq_stat = _sequence_max(token_values)
            if is_k1_option:
                seq_keep_bool_direct = (seq_stat >= lower_log) & (seq_stat <= upper_log)
            else:
                seq_keep_bool_direct = seq_stat <= upper_value
            per_sequence_stat = seq_stat
            token_keep_bool = seq_keep_bool_direct.unsqueeze(-1).expand_as(response_mask_bool)
            per_token_stat = seq_stat.unsqueeze(-1).expand_as(response_mask)

        metrics_upper_threshold = upper_log if is_k1_option else upper_value
        metrics_lower_threshold = lower_log if (is_k1_option and lower_log is not None) else 0.0

        token_keep_mask = token_keep_bool.to(dtype=log_ratio.dtype)
        combined_mask = combined_mask * token_keep_mask
        seq_keep_bool_tensor = (~((~token_keep_bool) & response_mask_bool)).all(dim=-1)

        metrics.update(
            compute_rs_metrics(
                option_name=option_name,
                rs_statistic=per_token_stat,
                response_mask=response_mask,
                seq_valid_mask=seq_valid_mask,
                level=level,
                per_sequence_values=per_sequence_stat,
                rollout_rs_threshold=metrics_upper_threshold,
                rollout_rs_threshold_lower=metrics_lower_threshold,
                apply_lower_threshold=apply_lower_threshold,
            )
        )

        token_masked_fraction = masked_mean(1 - token_keep_mask, response_mask).item()
        seq_valid_float = seq_valid_mask.float()
        if seq_valid_float.sum() > 0:
            seq_keep_float = seq_keep_bool_tensor.to(dtype=log_ratio.dtype)
            seq_masked_fraction = (((1.0 - seq_keep_float) * seq_valid_float).sum() / seq_valid_float.sum()).item()
        else:
            seq_masked_fraction = 0.0
        metrics[f"rollout_rs_{option_name}_masked_fraction"] = token_masked_fraction
        metrics[f"rollout_rs_{option_name}_seq_masked_fraction"] = seq_masked_fraction

    final_mask = combined_mask
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - final_mask, response_mask).item()
    final_keep_bool = (final_mask > 0.5) & response_mask_bool
    seq_has_masked = (~final_keep_bool & response_mask_bool).any(dim=-1)
    metrics["rollout_rs_seq_masked_fraction"] = seq_has_masked.float().mean().item()  # over ALL rows, incl. empty

    modified_response_mask = (response_mask * final_mask).to(dtype=response_mask.dtype)
    return modified_response_mask, metrics


def compute_rs_metrics(
    option_name: str,
    rs_statistic: torch.Tensor,
    response_mask: torch.Tensor,
    seq_valid_mask: torch.Tensor,
    *,
    level: str,
    per_sequence_values: Optional[torch.Tensor],
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float,
    apply_lower_threshold: bool,
) -> dict[str, float]:
    """verl/trainer/ppo/rollout_corr_helper.py L375-478 (verl @ b178a3cd).

    For k1 options the thresholds arrive in log space (log lower, log upper) and the statistic is ``-log ratio``;
    for k2/k3 the lower threshold is 0.0 and unused except as the std clamp floor."""
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    metrics: dict[str, float] = {}
    prefix = f"rollout_rs_{option_name}"
    mask_bool = response_mask.bool()

    if per_sequence_values is not None:
        seq_values = per_sequence_values
    else:
        seq_values = masked_mean(rs_statistic, response_mask, axis=-1)
    if seq_values.dim() > 1:
        seq_values = seq_values.squeeze(-1)
    seq_values_valid = seq_values[seq_valid_mask]

    # token-weighted mean (a sequence statistic is broadcast over its tokens first)
    metrics[f"{prefix}_mean"] = masked_mean(rs_statistic, response_mask).item()

    if level == "sequence" and seq_values_valid.numel() > 0:
        metrics[f"{prefix}_max"] = seq_values_valid.max().item()
        metrics[f"{prefix}_min"] = seq_values_valid.min().item()
        fraction_high = (seq_values_valid > rollout_rs_threshold).float().mean().item()
        fraction_low = (
            (seq_values_valid < rollout_rs_threshold_lower).float().mean().item() if apply_lower_threshold else 0.0
        )
    else:
        metrics[f"{prefix}_max"] = rs_statistic.masked_fill(~mask_bool, float("-inf")).max().item()
        metrics[f"{prefix}_min"] = rs_statistic.masked_fill(~mask_bool, float("inf")).min().item()
        fraction_high = masked_mean((rs_statistic > rollout_rs_threshold).float(), response_mask).item()
        fraction_low = (
            masked_mean((rs_statistic < rollout_rs_threshold_lower).float(), response_mask).item()
            if apply_lower_threshold
            else 0.0
        )
    metrics[f"{prefix}_fraction_high"] = fraction_high
    metrics[f"{prefix}_fraction_low"] = fraction_low

    if response_mask.sum() > 1:
        clamp_min = rollout_rs_threshold_lower if apply_lower_threshold else 0.0
        stat_for_std = rs_statistic.clamp(min=clamp_min, max=rollout_rs_threshold)
        mean_clamped = masked_mean(stat_for_std, response_mask)
        stat_var = masked_mean(stat_for_std.square(), response_mask) - mean_clamped.square()
        metrics[f"{prefix}_std"] = torch.sqrt(torch.clamp(stat_var, min=0.0)).item()
    else:
        metrics[f"{prefix}_std"] = 0.0

    if seq_values_valid.numel() > 0:
        metrics[f"{prefix}_seq_mean"] = seq_values_valid.mean().item()
        metrics[f"{prefix}_seq_std"] = seq_values_valid.std().item() if seq_values_valid.numel() > 1 else 0.0
        metrics[f"{prefix}_seq_max"] = seq_values_valid.max().item()
        metrics[f"{prefix}_seq_min"] = seq_values_valid.min().item()
        metrics[f"{prefix}_seq_max_deviation"] = (seq_values_valid - 0.0).abs().max().item()
        metrics[f"{prefix}_seq_fraction_high"] = (seq_values_valid > rollout_rs_threshold).float().mean().item()
        if apply_lower_threshold:
            metrics[f"{prefix}_seq_fraction_low"] = (
                (seq_values_valid < rollout_rs_threshold_lower).float().mean().item()
            )
    else:
        for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation"):
            metrics[f"{prefix}_{k}"] = 0.0
        for k in ("seq_fraction_high", "seq_fraction_low"):  # seq_fraction_low set even for k2/k3 here
            metrics[f"{prefix}_{k}"] = 0.0
    return metrics


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: Optional[torch.Tensor], response_mask: torch.Tensor
) -> dict[str, Any]:
    """verl/trainer/ppo/rollout_corr_helper.py L834-940 (verl @ b178a3cd). Always logged with rollout correction
    on (decoupled: pi_old vs pi_rollout once per step; actor: pi_theta vs pi_rollout per micro-batch)."""
    assert response_mask.any(), "Expected at least one valid token in response_mask"
    metrics = {}
    mean_log_prob_training = masked_mean(old_log_prob, response_mask, axis=-1)
    metrics["training_ppl"] = torch.exp(-mean_log_prob_training).mean().detach().item()
    metrics["training_log_ppl"] = (-mean_log_prob_training).mean().detach().item()
    if rollout_log_prob is not None:
        metrics["kl"] = masked_mean(rollout_log_prob - old_log_prob, response_mask).detach().item()
        log_ratio = old_log_prob - rollout_log_prob
        k3_kl_matrix = torch.exp(log_ratio) - log_ratio - 1  # no clamp here
        metrics["k3_kl"] = masked_mean(k3_kl_matrix, response_mask).detach().item()
        mean_log_prob_rollout = masked_mean(rollout_log_prob, response_mask, axis=-1)
        metrics["rollout_ppl"] = torch.exp(-mean_log_prob_rollout).mean().detach().item()
        metrics["rollout_log_ppl"] = (-mean_log_prob_rollout).mean().detach().item()
        log_ppl_diff = mean_log_prob_rollout - mean_log_prob_training
        metrics["log_ppl_diff"] = log_ppl_diff.mean().detach().item()
        metrics["log_ppl_abs_diff"] = log_ppl_diff.abs().mean().detach().item()
        metrics["log_ppl_diff_max"] = log_ppl_diff.max().detach().item()
        metrics["log_ppl_diff_min"] = log_ppl_diff.min().detach().item()
        metrics["ppl_ratio"] = torch.exp(log_ppl_diff).mean().detach().item()
        log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        metrics["chi2_token"] = (masked_mean(torch.exp(log_ratio_safe).square(), response_mask) - 1.0).detach().item()
        log_ratio_sum = masked_sum(log_ratio, response_mask, axis=-1)
        log_ratio_sum_safe = torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        metrics["chi2_seq"] = (torch.exp(2.0 * log_ratio_sum_safe).mean() - 1.0).detach().item()
    return metrics


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[str | float] = None,
) -> tuple[None, torch.Tensor, dict[str, float]]:
    """verl/trainer/ppo/rollout_corr_helper.py L716-831 (verl @ b178a3cd), without the ``rollout_is`` half.

    ``log_ratio = old_log_prob - rollout_log_prob``; RS on it; off-policy metrics on the *original* mask; every
    metric key gets the ``rollout_corr/`` prefix. Returns ``(None, modified_response_mask, metrics)``."""
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError("old_log_prob, rollout_log_prob and response_mask must have the same shape.")
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    modified_response_mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be explicitly provided when rollout_rs is enabled.")
        modified_response_mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio=log_ratio,
            response_mask=response_mask,
            rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold,
        )
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    metrics_scalar = {
        f"rollout_corr/{k}": (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()
    }
    return None, modified_response_mask, metrics_scalar


def geo_rs(old_log_prob, rollout_log_prob, response_mask, rollout_rs_threshold: str | float = GEO_RS_THRESHOLD):
    """Geo-RS as verl's presets configure it (algorithm.py L234-255: ``rollout_rs="seq_mean_k1"``,
    ``rollout_rs_threshold="0.999_1.001"``). Keeps a sequence iff
    ``log(lo) <= mean_t(-clamp(log(pi_old/pi_rollout), +-20)) <= log(hi)``, i.e. the geometric mean of
    **pi_rollout/pi_old** lies in ``[lo, hi]`` (the inverse of the documented rho_geo; same set when lo = 1/hi)."""
    return compute_rollout_correction_and_rejection_mask(
        old_log_prob,
        rollout_log_prob,
        response_mask,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold=rollout_rs_threshold,
    )


def k3_rs(
    old_log_prob,
    rollout_log_prob,
    response_mask,
    rollout_rs_threshold: float = K3_RS_THRESHOLD,
    rollout_rs: str = "seq_mean_k3",
):
    """K3-RS as verl's presets configure it (algorithm.py L478-502: ``rollout_rs="seq_mean_k3"``, threshold 0.01;
    ``"seq_sum_k3"`` is the sum variant). With ``lr = clamp(log(pi_old/pi_rollout), +-20)``, keeps a sequence iff
    ``reduce_t(exp(lr) - 1 - lr) <= rollout_rs_threshold``."""
    return compute_rollout_correction_and_rejection_mask(
        old_log_prob, rollout_log_prob, response_mask, rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold
    )


def bypass_mode_rejection(log_prob, rollout_log_prob, response_mask, rollout_rs, rollout_rs_threshold):
    """core_algos.py L2142-2165 (verl @ b178a3cd): in bypass mode (``old_log_prob`` := ``rollout_log_probs``) the
    RS runs inside the loss, per micro-batch, under ``no_grad``, with the *current* policy:
    ``log_ratio = log_prob - rollout_log_prob``. The result is the ``response_mask`` handed to the PPO-clip /
    REINFORCE loss; its metrics join the actor's metrics."""
    with torch.no_grad():
        _, modified_response_mask, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob,
            rollout_log_prob=rollout_log_prob,
            response_mask=response_mask,
            rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold,
        )
    return modified_response_mask, metrics


def legacy_geometric_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs_threshold: float = 1.001,
    rollout_rs_threshold_lower: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The *previous* API, for comparison only: ``compute_rollout_rejection_mask(rollout_rs="geometric")`` at verl
    commit 518bada2192c27268a787b280767e0c0f34acb0b (2025-12-15), rollout_corr_helper.py L82-193 (the
    ``rollout_rs_threshold_lower`` era; presets ``decoupled_geo_rs(rs_threshold=1.001, rs_threshold_lower=None,
    veto_threshold=1e-4)``, algorithm.py L232-259). Replaced by ``seq_mean_k1`` in 97eac904 (2026-01-14).

    ``rho_geo = exp(clamp(mean_t log(pi_old/pi_rollout), +-20))``; keep iff ``lower <= rho_geo <= upper`` with
    ``lower = rollout_rs_threshold_lower or 1/upper``. Note the orientation: pi_old/pi_rollout here, its inverse in
    ``seq_mean_k1``. Only the two masked-fraction metrics are transcribed (the legacy ``rollout_rs_mean/max/min/std/
    eff_sample_size/ratio_fraction_*/seq_*`` metrics and the separate ``rollout_token_veto_threshold`` veto are not).
    """
    upper_threshold = rollout_rs_threshold
    lower_threshold = rollout_rs_threshold_lower if rollout_rs_threshold_lower is not None else 1.0 / upper_threshold
    log_ratio_mean = masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
    log_ratio_mean_safe = torch.clamp(log_ratio_mean, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    rollout_is_weights = torch.exp(log_ratio_mean_safe).expand_as(log_ratio)
    mask = ((rollout_is_weights >= lower_threshold) & (rollout_is_weights <= upper_threshold)).float()
    metrics = {
        "rollout_rs_masked_fraction": masked_mean(1 - mask, response_mask).item(),
        "rollout_rs_seq_masked_fraction": (1 - mask[:, 0]).mean().item(),
    }
    return response_mask * mask, metrics


# ----------------------------------------------------------------------------------------------------------------
# Policy losses (core_algos.py)
# ----------------------------------------------------------------------------------------------------------------


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
):
    """verl/trainer/ppo/core_algos.py L1025-1080 (verl @ b178a3cd). The keyword arguments after ``loss_agg_mode``
    are ``config.global_batch_info`` (empty in the legacy ``dp_actor``: local micro-batch normalisation; filled by
    the engine workers from the global ``loss_mask`` count)."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        loss = torch.sum(seq_losses) / loss_scale_factor
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: Optional[float] = 0.2,
    clip_ratio_high: Optional[float] = 0.2,
    rollout_is_weights: Optional[torch.Tensor] = None,
    global_batch_info: Optional[dict] = None,
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    """verl/trainer/ppo/core_algos.py L1721-1779 (``@register_policy_loss("cispo")``, verl @ b178a3cd).

    ``pg_losses = -sg(clamp(exp(clamp(logp - old, +-20)), 1 - clip_ratio_low, 1 + clip_ratio_high)) * A * logp``;
    the gradient flows only through the final ``log_prob`` factor. Defaults are ``ActorConfig``'s
    (clip_ratio / clip_ratio_low / clip_ratio_high = 0.2; a None low/high falls back to clip_ratio)."""
    clip_ratio_low = clip_ratio_low if clip_ratio_low is not None else clip_ratio
    clip_ratio_high = clip_ratio_high if clip_ratio_high is not None else clip_ratio

    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_ratio_sg = clipped_ratio.detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob

    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)  # both sides, regardless of A's sign

    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **(global_batch_info or {})
    )
    pg_clipfrac_lower = torch.tensor(0.0, device=pg_loss.device)
    pg_metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, pg_metrics, pg_losses


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    rollout_is_weights: Optional[torch.Tensor] = None,
    global_batch_info: Optional[dict] = None,
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    """verl/trainer/ppo/core_algos.py L1329-1411 (``@register_policy_loss("sapo")``, verl @ b178a3cd).

    ``r = exp(clamp(logp - old, +-20))``, ``tau = tau_pos if A > 0 else tau_neg`` (A == 0 -> tau_neg),
    ``pg_losses = -sigmoid(tau * (r - 1)) * (4 / tau) * A``; the gradient flows through ``r``.
    ``loss_agg_mode`` is accepted and IGNORED: verl always aggregates SAPO with ``"seq-mean-token-mean"``.
    Defaults are ``ActorConfig``'s (tau_pos=1.0, tau_neg=1.05). ``actor/pg_clipfrac*`` are constant 0."""
    tau_pos = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)

    def gate_function(x, tau):
        return torch.sigmoid(tau * (x - 1.0)) * (4.0 / tau)

    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = gate_function(ratio, taus)
    pg_losses = -gates * advantages

    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode="seq-mean-token-mean", **(global_batch_info or {})
    )
    pg_clipfrac = torch.tensor(0.0, device=pg_loss.device)
    pg_clipfrac_lower = torch.tensor(0.0, device=pg_loss.device)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, pg_metrics, pg_losses


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """verl/trainer/ppo/core_algos.py L1867-1902 (verl @ b178a3cd). ``low_var_kl``/``k3``: log-ratio clamped to
    +-20, result clamped to [-10, 10]."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """verl/trainer/ppo/core_algos.py L1841-1864 (verl @ b178a3cd). A trailing ``+`` (e.g. ``"k3+"``) keeps the
    forward value but uses the k2 gradient (straight-through). Note: ``kl_penalty_forward`` is called with the name
    *including* the ``+``, which it does not recognise, so in this commit ``"k3+"`` raises NotImplementedError."""
    forward_score = kl_penalty_forward(logprob, ref_logprob, kl_penalty)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()

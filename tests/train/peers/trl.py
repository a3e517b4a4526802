"""Hugging Face TRL's GRPOTrainer corrections, transcribed: off-policy sequence masking (OPSM, DeepSeek-V3.2),
the ``cispo`` and ``sapo`` losses, and the vLLM importance-sampling weight (TIS/MIS, IcePop's two-sided mask when
both bounds are set), with the aggregation and metrics TRL's code applies.

Source: github.com/huggingface/trl at commit ``f2cd57710ae345ea6428ae95363267fcf38a3dc8`` (2026-07-24),
``trl/trainer/grpo_trainer.py`` (defaults from ``trl/trainer/grpo_config.py``). Layout is TRL's: right-padded
``[B, T]`` completion tensors, ``completion_mask`` (times ``tool_mask`` when present) as the loss mask,
advantages ``(B,)`` unsqueezed to ``(B, 1)``. Single process: ``accelerator.gather``/``reduce`` are identities.
Left out (TRL defaults off): ``beta`` KL term, entropy mask/bonus, Liger path, ``luspo``/``vespo``/``dr_grpo``.
"""

import math

import torch

TRL_COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"
TRL_FILE = "trl/trainer/grpo_trainer.py"

VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def loss_mask(completion_mask, tool_mask=None):
    """``mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]``
    (huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L2998 in _compute_loss; L2426 and L2580 likewise)."""
    return completion_mask if tool_mask is None else completion_mask * tool_mask


@torch.no_grad()
def vllm_importance_sampling_ratio(
    old_per_token_logps,
    sampling_per_token_logps,
    completion_mask,
    vllm_importance_sampling_mode="sequence_mask",
    vllm_importance_sampling_clip_min=None,
    vllm_importance_sampling_clip_max=3.0,
    tool_mask=None,
):
    """TIS/MIS weight ``exp(old - sampling)`` (trainer recompute over vLLM sampler), computed under ``no_grad``.

    huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L2579-L2623 (in ``_generate_and_score_completions``,
    inside ``torch.no_grad()`` opened at L2553). Token modes return ``(B, T)`` (padded positions: ``exp(0) = 1``);
    sequence modes return ``(B, 1)`` = ``exp(sum_t (old - sampling) * mask)`` (a product, no length
    normalisation). ``*_truncate`` clamps to ``[clip_min, clip_max]``; ``*_mask`` sets ratios outside it to 0
    (a missing bound is open). Defaults are GRPOConfig's (grpo_config.py L924-L952). The trainer multiplies the
    per-token loss by this weight (L3117-L3118) for every loss type but ``vespo``.
    """
    mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask

    sequence_level_is = vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff

    vllm_importance_sampling_ratio = torch.exp(logps_diff)

    if vllm_importance_sampling_mode in ["sequence_truncate", "token_truncate"]:
        vllm_importance_sampling_ratio = torch.clamp(
            vllm_importance_sampling_ratio,
            min=vllm_importance_sampling_clip_min,
            max=vllm_importance_sampling_clip_max,
        )
    elif vllm_importance_sampling_mode in ["sequence_mask", "token_mask"]:
        min_val = vllm_importance_sampling_clip_min if vllm_importance_sampling_clip_min is not None else -math.inf
        max_val = vllm_importance_sampling_clip_max if vllm_importance_sampling_clip_max is not None else math.inf
        invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (vllm_importance_sampling_ratio > max_val)
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(invalid_mis_mask, value=0.0)
    else:
        raise ValueError(f"Unknown vLLM importance sampling level: {vllm_importance_sampling_mode}.")
    return vllm_importance_sampling_ratio


@torch.no_grad()
def vllm_importance_sampling_metrics(
    old_per_token_logps,
    sampling_per_token_logps,
    importance_sampling_ratio,
    completion_mask,
    vllm_importance_sampling_mode="sequence_mask",
    tool_mask=None,
):
    """The ``sampling/*`` metrics, single process.

    huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L2779-L2813. ``sampling_logp_difference`` is
    ``|old - sampling|`` over mask tokens; the ratio stats are of the weight *after* truncation/masking (masked
    entries count as 0), over mask tokens (token modes) or over all ``B`` rows (sequence modes).
    """
    delta = torch.abs(old_per_token_logps - sampling_per_token_logps)
    mask = completion_mask.bool() if tool_mask is None else (completion_mask * tool_mask).bool()
    delta = delta[mask]
    zero = torch.tensor(0.0, device=delta.device)
    mean_delta = torch.mean(delta) if delta.numel() > 0 else zero
    max_delta = torch.max(delta) if delta.numel() > 0 else zero
    if vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]:
        flat_is_ratio = importance_sampling_ratio.flatten()
    else:
        flat_is_ratio = importance_sampling_ratio[mask]
    n = flat_is_ratio.numel()
    return {
        "sampling/sampling_logp_difference/mean": mean_delta.item(),
        "sampling/sampling_logp_difference/max": max_delta.item(),
        "sampling/importance_sampling_ratio/min": (torch.min(flat_is_ratio) if n > 0 else zero).item(),
        "sampling/importance_sampling_ratio/mean": (torch.mean(flat_is_ratio) if n > 0 else zero).item(),
        "sampling/importance_sampling_ratio/max": (torch.max(flat_is_ratio) if n > 0 else zero).item(),
    }


def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    """OPSM keep-mask ``(B, 1)``: drop iff ``A < 0`` and ``mean_t(sampling - current) > threshold``.

    huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L2919-L2939 (``GRPOTrainer.get_off_policy_mask``);
    caller L3039-L3052 picks ``sampling_per_token_logps`` = vLLM's logprobs when present, else
    ``old_per_token_logps`` (itself ``per_token_logps.detach()`` when not computed, giving KL 0 = keep all);
    applied as ``per_token_loss * off_policy_mask`` at L3111-L3112, before the IS weight, leaving the
    aggregation's denominators unchanged. Returns a float tensor of ``mask``'s dtype, no gradient.
    """
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    is_pos_adv = advantages >= 0
    is_low_kl = avg_seq_kl <= off_policy_threshold
    return (is_pos_adv | is_low_kl).to(dtype=mask.dtype)


def compute_coef_1(per_token_logps, old_per_token_logps, mask, importance_sampling_level="token"):
    """``coef_1 = exp(log_importance_weights)``: ``(B, T)`` per token, or ``(B, 1)`` = exp of the masked *mean*
    log-ratio for ``importance_sampling_level="sequence"``. ``old_per_token_logps=None`` means TRL's
    ``per_token_logps.detach()``. huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L3036-L3037,
    L3054-L3066."""
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    elif importance_sampling_level == "sequence":
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    else:
        raise ValueError(f"Unknown importance sampling level: {importance_sampling_level}.")
    return torch.exp(log_importance_weights)


def cispo_per_token_loss(coef_1, advantages, per_token_logps, epsilon_high):
    """``-sg(min(coef_1, epsilon_high)) * A * logp``: ``epsilon_high`` is the ratio cap itself (ScaleRL's
    eps_max, recommended 5.0), not ``1 + eps``; no lower clip. In TRL ``epsilon_high=None`` falls back to
    ``epsilon`` (0.2), i.e. a 0.2 cap. huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L3080-L3082
    (fallback L920-L921)."""
    clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
    return -clamped_ratios * advantages * per_token_logps


def sapo_per_token_loss(coef_1, advantages, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05):
    """``-sigmoid(tau * (coef_1 - 1)) * 4 / tau * A``, ``tau = sapo_temperature_pos if A > 0 else
    sapo_temperature_neg`` (so ``A == 0`` takes the negative temperature; its loss is 0 anyway). Gradient flows
    through ``coef_1``. huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L3092-L3095; defaults
    grpo_config.py L704-L719."""
    temperatures = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    return -soft_coef_1 * advantages


def clipped_per_token_loss(coef_1, advantages, epsilon_low, epsilon_high, delta=None):
    """The ``grpo``/``bnpo``/``dr_grpo``/``dapo`` clipped surrogate (for OPSM/IS with the default loss).
    huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L3083-L3091."""
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages)


def _global_masked_mean(x, mask):
    """huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L3229-L3235, one process."""
    if x.shape[1] == 1:
        local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
    else:
        local_sum, local_count = (x * mask).sum(), mask.sum().float()
    return (local_sum / local_count.clamp(min=1.0)).item()


def _masked_seq_mean(x, mask):
    """huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L3224-L3227."""
    if x.shape[1] == 1:
        return x.squeeze(1)
    return (x * mask).sum(-1) / mask.sum(-1)


def compute_loss(
    per_token_logps,
    old_per_token_logps,
    advantages,
    completion_mask,
    loss_type="dapo",
    *,
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    importance_sampling_level="token",
    off_policy_mask_threshold=None,
    sampling_per_token_logps=None,
    importance_sampling_ratio=None,
    num_items_in_batch=None,
    num_processes=1,
    current_gradient_accumulation_steps=1,
    training=True,
    tool_mask=None,
):
    """``GRPOTrainer._compute_loss`` for ``loss_type`` in grpo/bnpo/dapo/cispo/sapo with ``beta=0`` and no
    entropy terms; returns ``(loss, per_token_loss, metrics)``.

    huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py L2991-L3142 (loss) and L3223-L3258 (metrics).
    ``importance_sampling_ratio``: the output of :func:`vllm_importance_sampling_ratio` (pass it only when TRL
    would: ``use_vllm`` and ``vllm_importance_sampling_correction``). ``sampling_per_token_logps``: vLLM's
    logprobs (only read by OPSM here). ``num_items_in_batch``: TRL's global loss-mask token count over the whole
    generation batch on all ranks (L2426-L2427); defaults to this batch's. Aggregation: grpo/sapo = mean over
    sequences of the per-sequence token mean, ``/ current_gradient_accumulation_steps`` when training; bnpo =
    local token mean ``/ steps``; cispo/dapo = token sum ``/ (num_items_in_batch / num_processes)``.
    ``metrics``: ``clip_ratio/{low_mean,high_mean,region_mean,low_min,high_max}`` (grpo/bnpo/dapo),
    ``cispo_clip_ratio`` (cispo), none for sapo; OPSM logs nothing.
    """
    mask = loss_mask(completion_mask, tool_mask)
    epsilon_low = epsilon
    epsilon_high = epsilon_high if epsilon_high is not None else epsilon
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps

    if off_policy_mask_threshold is not None:
        opsm_logps = sampling_per_token_logps if sampling_per_token_logps is not None else old_per_token_logps
        off_policy_mask = get_off_policy_mask(advantages, per_token_logps, opsm_logps, mask, off_policy_mask_threshold)

    coef_1 = compute_coef_1(per_token_logps, old_per_token_logps, mask, importance_sampling_level)

    if loss_type == "cispo":
        per_token_loss = cispo_per_token_loss(coef_1, advantages, per_token_logps, epsilon_high)
    elif loss_type in ["grpo", "bnpo", "dapo"]:
        per_token_loss = clipped_per_token_loss(coef_1, advantages, epsilon_low, epsilon_high, delta)
    elif loss_type == "sapo":
        per_token_loss = sapo_per_token_loss(coef_1, advantages, sapo_temperature_pos, sapo_temperature_neg)
    else:
        raise ValueError(f"Unsupported loss type in this transcription: {loss_type}")

    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio

    steps = current_gradient_accumulation_steps if training else 1.0
    if loss_type in ["grpo", "sapo"]:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / steps
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / steps
    else:  # cispo, dapo
        if num_items_in_batch is None:
            num_items_in_batch = mask.sum()
        num_items_in_batch = torch.as_tensor(num_items_in_batch, dtype=per_token_loss.dtype)
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        loss = (per_token_loss * mask).sum() / normalizer

    metrics = {}
    if loss_type in ["grpo", "bnpo", "dapo"]:
        is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        metrics["clip_ratio/low_mean"] = _global_masked_mean(is_low_clipped.float(), mask)
        metrics["clip_ratio/high_mean"] = _global_masked_mean(is_high_clipped.float(), mask)
        metrics["clip_ratio/region_mean"] = _global_masked_mean(is_region_clipped.float(), mask)
        metrics["clip_ratio/low_min"] = _nanmin(_masked_seq_mean(is_low_clipped.float(), mask)).item()
        metrics["clip_ratio/high_max"] = _nanmax(_masked_seq_mean(is_high_clipped.float(), mask)).item()
    elif loss_type == "cispo":
        is_cispo_clipped = (coef_1 > epsilon_high) & (advantages > 0)
        metrics["cispo_clip_ratio"] = _global_masked_mean(is_cispo_clipped.float(), mask)
    return loss, per_token_loss, metrics


def _nanmin(t):
    """huggingface/trl@f2cd577, trl/trainer/utils.py L960-L972 ``nanmin``: min ignoring NaN, NaN if all NaN."""
    t = t[~torch.isnan(t)]
    return torch.tensor(float("nan")) if t.numel() == 0 else t.min()


def _nanmax(t):
    """huggingface/trl@f2cd577, trl/trainer/utils.py L975-L987 ``nanmax``: max ignoring NaN, NaN if all NaN."""
    t = t[~torch.isnan(t)]
    return torch.tensor(float("nan")) if t.numel() == 0 else t.max()

"""slime's (github.com/THUDM/slime) policy-loss code for OPSM, CISPO and its TIS/IcePop weights, transcribed.

Commit 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21, "[NFC] Add observability subfolder (#2298)").

slime's layout, kept here: per-sample lists of 1-D response tensors (``log_probs``, ``advantages``,
``loss_masks``, ...) in a ``batch`` dict, and 1-D tensors made by ``torch.cat`` of those lists for the
per-token losses. ``loss_masks`` are int tensors over the full response; with context parallelism
(CP) the other lists hold only this rank's chunk. Everything below is the CP size 1 case, where
``all_gather_with_cp`` is the identity.

Deliberate differences from slime, none of which changes a value or a gradient:
- no ``@torch.compile(dynamic=True)`` (slime compiles ``compute_approx_kl``, ``compute_policy_loss``
  and ``compute_cispo_loss``; fused kernels may round differently in the last bit);
- ``policy_loss_function`` takes the current per-sample ``log_probs`` (and optional ``entropy``)
  instead of computing them from Megatron logits;
- ``args.custom_tis_function`` is a callable, where slime loads ``--custom-tis-function-path``;
  ``--custom-pg-loss-reducer-function-path``, GSPO and OPD metrics are left out.
"""

from argparse import Namespace

import torch

COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"

# slime's defaults for the flags used here (slime/utils/arguments.py, lines 899-1114 and 1876-1877).
DEFAULTS = dict(
    eps_clip=0.2,  # --eps-clip
    eps_clip_high=None,  # --eps-clip-high; None becomes eps_clip after parsing
    eps_clip_c=None,  # --eps-clip-c (dual-clip PPO; not used by CISPO)
    advantage_estimator="grpo",  # --advantage-estimator {grpo,gspo,cispo,reinforce_plus_plus,...,ppo}
    use_opsm=False,  # --use-opsm
    opsm_delta=1e-4,  # --opsm-delta
    use_tis=False,  # --use-tis
    tis_clip=2.0,  # --tis-clip      (upper bound, TIS and IcePop)
    tis_clip_low=0.0,  # --tis-clip-low  (lower bound, TIS and IcePop)
    get_mismatch_metrics=False,  # --get-mismatch-metrics
    use_rollout_logprobs=False,  # --use-rollout-logprobs
    calculate_per_token_loss=False,  # --calculate-per-token-loss
    entropy_coef=0.0,  # --entropy-coef
    use_kl_loss=False,  # --use-kl-loss
    kl_loss_coef=0.0,  # --kl-loss-coef
    kl_loss_type="k1",  # --kl-loss-type
    use_unbiased_kl=False,  # --use-unbiased-kl
)


def make_args(**overrides) -> Namespace:
    """slime's parsed args for these flags, with its post-parse rule ``eps_clip_high = eps_clip`` when unset.
    THUDM/slime@624b824a, slime/utils/arguments.py lines 899-1114 (defaults) and 1876-1877."""
    args = Namespace(**{**DEFAULTS, "custom_tis_function": None, **overrides})
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    return args


def compute_opsm_mask(
    args: Namespace,
    full_log_probs: list[torch.Tensor],
    full_old_log_probs: list[torch.Tensor],
    advantages: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPSM mask. THUDM/slime@624b824a, slime/utils/ppo_utils.py lines 54-92.

    Per sample: ``seq_kl = sum((old - cur) * loss_mask) / max(sum(loss_mask), 1)``, the loss-masked mean of
    ``log(pi_old / pi_theta)``; ``old`` is the training engine's recomputed log-probs, or the rollout engine's
    when ``--use-rollout-logprobs`` is set (the caller picks). A token is dropped where ``advantage < 0`` (that
    token's advantage) and ``seq_kl > args.opsm_delta``. ``cur`` keeps its graph, but the mask is a comparison,
    so no gradient passes through it. Returns ``(1 - mask)`` concatenated over samples (float, 1-D) and
    ``opsm_clipfrac = sum_i(masked tokens_i / max(sum(loss_mask_i), 1))``, a sum over samples (not a mean)
    that is not limited to loss-masked tokens.
    """
    opsm_mask_list = []
    device = advantages[0].device
    opsm_clipfrac = torch.tensor(0.0, device=device)

    for full_log_prob, full_old_log_prob, advantage, loss_mask in zip(
        full_log_probs, full_old_log_probs, advantages, loss_masks, strict=False
    ):
        # Calculate sequence-level KL
        seq_kl = ((full_old_log_prob - full_log_prob) * loss_mask).sum() / torch.clamp_min(loss_mask.sum(), 1)

        # Create mask: 0 if (advantage < 0 and seq_kl > delta), else 1
        mask = ((advantage < 0) & (seq_kl > args.opsm_delta)).float()
        opsm_clipfrac += mask.sum() / torch.clamp_min(loss_mask.sum(), 1)

        opsm_mask_list.append(1 - mask)

    opsm_mask = torch.cat(opsm_mask_list, dim=0)
    return opsm_mask, opsm_clipfrac


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped per-token loss, which OPSM multiplies by default. THUDM/slime@624b824a,
    slime/utils/ppo_utils.py lines 124-148. ``ppo_kl = old_log_probs - log_probs`` (1-D, concatenated)."""
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).float()

    if eps_clip_c is not None:
        assert (
            eps_clip_c > 1.0
        ), (
            "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0, "
            f"but get the value: {eps_clip_c}."
        )
        pg_losses3 = -eps_clip_c * advantages
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    else:
        pg_losses = clip_pg_losses1

    return pg_losses, clipfrac


def compute_cispo_loss(
    ppo_kl: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO per-token loss ``-sg(clamp(r, 1 - eps_clip, 1 + eps_clip_high)) * A * log_probs``, ``r = exp(-ppo_kl)``.
    THUDM/slime@624b824a, slime/utils/ppo_utils.py lines 151-171.

    The lower bound is always applied (``1 - eps_clip``; default eps_clip 0.2 gives 0.8, and slime only warns);
    ``eps_clip >= 1`` removes it. Gradient flows only through ``log_probs``. ``clipfrac`` marks every token whose
    ratio the clamp changed, on either side and for either sign of A.
    """
    ratio = (-ppo_kl).exp()
    ratio_truncated = torch.clamp(ratio, min=1.0 - eps_clip, max=1.0 + eps_clip_high)
    pg_losses = -ratio_truncated.detach() * advantages * log_probs
    clipfrac = (ratio_truncated != ratio).float()
    return pg_losses, clipfrac


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL loss term. THUDM/slime@624b824a, slime/utils/ppo_utils.py lines 11-51."""
    log_ratio = log_probs.float() - log_probs_base.float()

    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_loss_type in ["k3", "low_var_kl"]:
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    else:
        raise ValueError(f"Unknown kl_loss_type: {kl_loss_type}")

    # Apply IS ratio for unbiased KL estimation (DeepSeek-V3.2)
    if importance_ratio is not None:
        kl = importance_ratio * kl

    # Clamp only for low_var_kl for numerical stability
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)

    return kl


def vanilla_tis_function(
    args,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """TIS (the default with ``--use-tis``): ``pg_loss * clamp(exp(old - rollout), tis_clip_low, tis_clip)``.
    THUDM/slime@624b824a, slime/backends/megatron_utils/loss.py lines 884-905. Masks are returned unchanged."""
    rollout_log_probs = torch.cat(rollout_log_probs, dim=0)
    old_log_probs = torch.cat(train_log_probs, dim=0)
    tis = torch.exp(old_log_probs - rollout_log_probs)
    tis_abs = (torch.exp(old_log_probs - rollout_log_probs) - 1).abs()
    tis_weights = torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip)
    tis_clipfrac = (tis_weights != tis).float()
    metrics = {
        "tis": tis.clone().detach(),
        "tis_clipfrac": tis_clipfrac.clone().detach(),
        "tis_abs": tis_abs.clone().detach(),
    }
    pg_loss = pg_loss * tis_weights
    return pg_loss, loss_masks, metrics


def icepop_function(
    args,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """IcePop (two-sided token masking): weight ``r = exp(old - rollout)`` where ``tis_clip_low <= r <= tis_clip``,
    else 0. THUDM/slime@624b824a, slime/backends/megatron_utils/loss.py lines 908-931; reached only through
    ``--custom-tis-function-path slime.backends.megatron_utils.loss.icepop_function``. Masks are returned
    unchanged, so masked tokens stay in the denominators. Metric names are the TIS ones."""
    rollout_log_probs = torch.cat(rollout_log_probs, dim=0)
    old_log_probs = torch.cat(train_log_probs, dim=0)
    ice_ratio = torch.exp(old_log_probs - rollout_log_probs)
    ice_abs = (torch.exp(old_log_probs - rollout_log_probs) - 1).abs()
    ice_weight = torch.where(
        (ice_ratio >= args.tis_clip_low) & (ice_ratio <= args.tis_clip), ice_ratio, torch.zeros_like(ice_ratio)
    )
    ice_clipfrac = (ice_weight != ice_ratio).float()
    metrics = {
        "tis": ice_ratio.clone().detach(),
        "tis_clipfrac": ice_clipfrac.clone().detach(),
        "tis_abs": ice_abs.clone().detach(),
    }
    pg_loss = pg_loss * ice_weight
    return pg_loss, loss_masks, metrics


def get_sum_of_sample_mean(
    total_lengths: list[int],
    response_lengths: list[int],
    loss_masks: list[torch.Tensor],
    sample_denoms=None,
    calculate_per_token_loss: bool = False,
):
    """slime's reducer, CP size 1. THUDM/slime@624b824a, slime/backends/megatron_utils/cp_utils.py lines 47-89, 124.

    ``x`` is 1-D (concatenated samples). The default gives ``sum_i sum_t(x_i * m_i) / max(denom_i, 1)``, a *sum* over
    samples; ``denom_i`` is ``sample_denoms[i]`` (slime passes ``batch["rollout_mask_sums"]``: the loss-mask total of
    every sample sharing sample i's rollout id, which is ``sum(m_i)`` when each sample is its own rollout) or
    ``sum(m_i)``. The division by the number of rollouts happens later (``loss_function``,
    ``reduce_train_step_metrics``). ``calculate_per_token_loss`` gives the masked token sum.
    """
    if sample_denoms is None:
        sample_denoms = [m.sum() for m in loss_masks]
    # slime's denominators are already tensors (float32 on the GPU); accept plain numbers here too.
    sample_denoms = [torch.as_tensor(d, dtype=torch.float32) for d in sample_denoms]

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        return sum(
            [
                (x_i * loss_mask_i).sum() / torch.clamp_min(denom, 1)
                for x_i, loss_mask_i, denom in zip(
                    x.split(response_lengths, dim=0), loss_masks, sample_denoms, strict=False
                )
            ]
        )

    def sum_of_token(x: torch.Tensor) -> torch.Tensor:
        return sum(
            [
                (x_i * loss_mask_i).sum()
                for x_i, loss_mask_i in zip(x.split(response_lengths, dim=0), loss_masks, strict=False)
            ]
        )

    return sum_of_sample_mean if not calculate_per_token_loss else sum_of_token


def policy_loss_function(
    args: Namespace,
    batch: dict,
    log_probs: list[torch.Tensor],
    sum_of_sample_mean,
    entropy: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch of slime's policy loss, CP size 1. THUDM/slime@624b824a,
    slime/backends/megatron_utils/loss.py lines 934-1173 (OPSM 991-1018 and 1046-1047, CISPO 1035-1036,
    TIS 1049-1092, metrics 1142-1166).

    ``log_probs``: the current policy's per-sample log-probs (with grad), in place of slime's computation from
    logits; ``entropy`` likewise (``None`` reads as zeros). ``batch`` keys: ``advantages``, ``loss_masks``,
    ``response_lengths``, ``total_lengths``, and as needed ``log_probs`` (old, training engine),
    ``rollout_log_probs``, ``ref_log_probs``, ``rollout_mask_sums``. ``sum_of_sample_mean`` is built by
    ``get_sum_of_sample_mean`` from ``batch["loss_masks"]`` and ``batch.get("rollout_mask_sums")``.

    Returns slime's ``(loss, reported_loss)``. ``loss`` is the micro-batch loss before ``loss_function`` scales it
    (``* num_microbatches / step_global_batch_size * dp_cp_size``; Megatron then divides by num_microbatches), so
    one micro-batch on one rank trains on ``loss / step_global_batch_size``. Reported values are micro-batch sums;
    ``reduce_train_step_metrics`` turns them into the logged ``train/<key>`` numbers.
    """
    assert args.advantage_estimator != "gspo", "GSPO is not transcribed here"
    advantages = torch.cat(batch["advantages"], dim=0)
    old_log_probs = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")

    response_lengths = batch["response_lengths"]
    total_lengths = batch["total_lengths"]

    if not args.use_rollout_logprobs and not old_log_probs:
        old_log_probs = [log_prob.detach() for log_prob in log_probs]
    train_log_probs_for_tis = batch.get("log_probs")
    if not train_log_probs_for_tis:
        train_log_probs_for_tis = [log_prob.detach() for log_prob in log_probs]

    # all_gather_with_cp is the identity at CP size 1.
    if args.use_opsm:
        opsm_mask, opsm_clipfrac = compute_opsm_mask(
            args=args,
            full_log_probs=log_probs,
            full_old_log_probs=old_log_probs,
            advantages=batch["advantages"],
            loss_masks=batch["loss_masks"],
        )

    old_log_probs = torch.cat(old_log_probs, dim=0)
    log_probs = torch.cat(log_probs, dim=0)
    ppo_kl = old_log_probs - log_probs

    if args.advantage_estimator == "cispo":
        pg_loss, pg_clipfrac = compute_cispo_loss(ppo_kl, log_probs, advantages, args.eps_clip, args.eps_clip_high)
    else:
        pg_loss, pg_clipfrac = compute_policy_loss(
            ppo_kl, advantages, args.eps_clip, args.eps_clip_high, eps_clip_c=args.eps_clip_c
        )

    if args.use_opsm:
        pg_loss = pg_loss * opsm_mask

    if args.get_mismatch_metrics or args.use_tis:
        sum_of_sample_mean_for_mismatch_metrics = sum_of_sample_mean
        assert "rollout_log_probs" in batch, "rollout_log_probs must be provided for TIS"
        ois = (-ppo_kl).exp()
        tis_func = args.custom_tis_function or vanilla_tis_function
        pg_loss, modified_response_masks, tis_metrics = tis_func(
            args=args,
            pg_loss=pg_loss,
            train_log_probs=train_log_probs_for_tis,
            rollout_log_probs=batch["rollout_log_probs"],
            loss_masks=batch["loss_masks"],
            total_lengths=total_lengths,
            response_lengths=response_lengths,
        )
        # Numerators use the returned masks; denominators stay the rollout totals of the original masks.
        sum_of_sample_mean = get_sum_of_sample_mean(
            total_lengths,
            response_lengths,
            modified_response_masks,
            batch.get("rollout_mask_sums"),
            args.calculate_per_token_loss,
        )

    pg_loss = sum_of_sample_mean(pg_loss)
    pg_clipfrac = sum_of_sample_mean(pg_clipfrac)
    ppo_kl = sum_of_sample_mean(ppo_kl)

    entropy = torch.zeros_like(log_probs) if entropy is None else torch.cat(entropy, dim=0)
    entropy_loss = sum_of_sample_mean(entropy)

    loss = pg_loss - args.entropy_coef * entropy_loss

    if args.use_kl_loss:
        ref_log_probs = torch.cat(batch["ref_log_probs"], dim=0)
        importance_ratio = None
        if args.use_unbiased_kl:
            importance_ratio = torch.exp(log_probs - old_log_probs)
        kl = compute_approx_kl(
            log_probs, ref_log_probs, kl_loss_type=args.kl_loss_type, importance_ratio=importance_ratio
        )
        kl_loss = sum_of_sample_mean(kl)
        loss = loss + args.kl_loss_coef * kl_loss

    train_rollout_logprob_abs_diff = None
    if "rollout_log_probs" in batch and batch["rollout_log_probs"]:
        rollout_log_probs = torch.cat(batch["rollout_log_probs"], dim=0)
        log_probs_to_compare = log_probs if args.use_rollout_logprobs else old_log_probs
        train_rollout_logprob_abs_diff = sum_of_sample_mean((log_probs_to_compare - rollout_log_probs).abs())

    reported_loss = {
        "loss": loss.clone().detach(),
        "pg_loss": pg_loss.clone().detach(),
        "entropy_loss": entropy_loss.clone().detach(),
        "pg_clipfrac": pg_clipfrac.clone().detach(),
        "ppo_kl": ppo_kl.clone().detach(),
    }
    if train_rollout_logprob_abs_diff is not None:
        reported_loss["train_rollout_logprob_abs_diff"] = train_rollout_logprob_abs_diff.clone().detach()
    if args.use_kl_loss:
        reported_loss["kl_loss"] = kl_loss.clone().detach()
    if args.get_mismatch_metrics or args.use_tis:
        reported_loss["ois"] = sum_of_sample_mean_for_mismatch_metrics(ois).clone().detach()
        for metric_key, metric_value in tis_metrics.items():
            reported_loss[metric_key] = sum_of_sample_mean_for_mismatch_metrics(metric_value)
    if args.use_opsm:
        reported_loss["opsm_clipfrac"] = opsm_clipfrac

    return loss, reported_loss


def reduce_train_step_metrics(
    reported_losses: list[dict[str, torch.Tensor]],
    *,
    calculate_per_token_loss: bool,
    step_global_batch_size: int,
    num_tokens: float | None = None,
    cp_size: int = 1,
) -> dict[str, float]:
    """The logged ``train/<key>`` values for one step, one rank. THUDM/slime@624b824a,
    slime/observability/train_metric_utils.py lines 18-59 (the DP/CP all-reduce of the sums is left out).

    Each micro-batch's values are summed, then divided by ``step_global_batch_size`` (the number of rollouts in the
    step), or with ``calculate_per_token_loss`` by the step's ``num_tokens`` (sum over samples of
    ``max(sum(loss_mask), 1)``, slime/backends/megatron_utils/loss.py line 1317) and multiplied by ``cp_size``.
    So ``train/opsm_clipfrac`` is (masked-token fractions summed over samples) / rollouts.
    """
    keys = list(reported_losses[0].keys())
    values = [sum(float(r[k]) for r in reported_losses) for k in keys]
    if calculate_per_token_loss:
        assert num_tokens is not None
        denom, cp_factor = num_tokens, cp_size
    else:
        denom, cp_factor = step_global_batch_size, 1
    return {k: v * cp_factor / denom for k, v in zip(keys, values, strict=True)}

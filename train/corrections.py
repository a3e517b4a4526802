"""Off-policy corrections beyond PPO's clip: other surrogates (CISPO, SAPO, DPPO) and masks that drop tokens or
whole sequences too far off the policy that sampled them (OPSM, M2PO, Geo-RS, K3-RS, DPPO's binary TV mask).
Pure functions of packed ``[T]`` tensors (shapes as in :mod:`rollshard.train.losses`, which applies them).

Three policies appear (REFERENCE.md "Loss formulas"): ``pi_theta`` the policy being trained (``logp``, the only
input with a graph), ``mu`` the engine that sampled the tokens (the stored ``rollout_logprobs``), and ``pi_prox``
the trainer's policy before this step's updates (decoupled mode's proximal policy; in bypass mode the policy
being trained, detached, stands in for it: with one mini-batch it is the same tensor). Each correction says which
two it compares; each follows one peer's code, named beside it with the file and lines read.

Surrogates (per-token loss before aggregation, ``r`` the loss's ratio, ``A`` the advantage):

* CISPO (MiniMax-M1; slime ``ppo_utils.compute_cispo_loss``, verl ``compute_policy_loss_cispo``, TRL
  ``loss_type="cispo"``): ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta``: a clipped token keeps its
  gradient, scaled by the clipped ratio. The paper clips only from above; slime and verl clip both sides by
  default, TRL caps at ``epsilon_high`` itself. rollshard's defaults are the paper's: ``eps_low`` 1 (the lower bound
  is 0, which a ratio never crosses) and ``eps_high`` 4 (cap 5, TRL's documented ``epsilon_high=5.0`` and slime's
  recommended ``--eps-clip-high 4``).
* SAPO (arXiv 2511.20347; AReaL ``sapo_loss_fn``, TRL ``loss_type="sapo"``, verl ``compute_policy_loss_sapo``):
  ``-(4 / tau) sigmoid(tau (r - 1)) A``, ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``: a soft trust region
  whose gradient is the plain policy gradient at ``r = 1`` and fades smoothly away from it; no clip.
* DPPO (prime-rl's default loss, ``trainer/rl/loss.py default_loss_fn``): ``-keep A r`` with no clip, ``keep`` the
  binary total-variation mask below, plus ``kl_tau (log pi_theta - log mu)^2`` on every loss token.

Masks (``keep [T]`` bool; a dropped token's policy loss is 0, and it still counts in the aggregation's
normalizer, as in TRL, slime and prime-rl):

* OPSM (DeepSeek-V3.2; slime ``--use-opsm``, TRL ``off_policy_mask_threshold``): drop sequence ``i`` when
  ``A_i < 0`` and ``mean_t (log mu - log pi_theta) > delta``. ``mu`` is the stored engine logprob, as the paper and
  TRL say (slime compares with its recomputed old logprob unless ``--use-rollout-logprobs``).
* M2PO (AReaL ``actor.m2_threshold``, ``actor.py _apply_m2po_masking``): over a micro-batch's loss tokens, drop
  the largest ``(log pi_prox - log mu)^2`` until the mean of the rest is below ``tau`` (strictly; if no such
  point exists, only the smallest is kept). AReaL pools the tokens of one micro-batch, and so does rollshard.
* Geo-RS (verl ``rollout_rs="seq_mean_k1"``): keep sequence ``i`` when the geometric mean over its loss tokens of
  ``pi_prox / mu`` lies in ``[lo, hi]``. verl's code tests ``k1 = -log(pi_prox / mu)`` against
  ``[log lo, log hi]``, the geometric mean of ``mu / pi_prox``; its documentation states ``pi_prox / mu``.
  rollshard follows the documentation (every ratio here has the trained policy on top); verl's threshold
  ``"lo_hi"`` is rollshard's ``1/hi, 1/lo``. The two agree for ``lo = 1 / hi``.
* K3-RS (verl ``rollout_rs="seq_mean_k3"`` / ``"seq_sum_k3"``): keep sequence ``i`` when the mean (or sum) over
  its loss tokens of ``rho - 1 - log rho``, ``rho = pi_prox / mu``, is at most ``threshold``.
* DPPO's binary TV mask: drop a token when ``A > 0`` and ``p_theta - p_mu > high``, or ``A <= 0`` and
  ``p_theta - p_mu < -low`` (probabilities, not logs; strict comparisons).
"""

from __future__ import annotations

import math

import torch

from rollshard.train.config import CISPO_EPS_DEFAULTS, LossConfig
from rollshard.train.segments import segment_mean, segment_sum, sequence_ids


def cispo_loss(
    logp: torch.Tensor,  # [T] pi_theta, requires grad
    ratio: torch.Tensor,  # [T] the loss's ratio
    advantages: torch.Tensor,  # [T]
    *,
    eps_low: float,
    eps_high: float,
) -> torch.Tensor:  # [T]
    """CISPO's per-token loss ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta``."""
    weight = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)  # [T] no gradient through the weight
    return -weight * advantages * logp


def sapo_gate(
    ratio: torch.Tensor,  # [T]
    advantages: torch.Tensor,  # [T]
    *,
    tau_pos: float,
    tau_neg: float,
) -> torch.Tensor:  # [T]
    """SAPO's scaled soft gate ``(4 / tau) sigmoid(tau (r - 1))``, ``tau`` by the advantage's sign (AReaL's
    ``sapo_soft_gate``)."""
    tau = torch.where(advantages > 0, tau_pos, tau_neg)  # [T]
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_loss(
    ratio: torch.Tensor,  # [T] requires grad
    advantages: torch.Tensor,  # [T]
    *,
    tau_pos: float,
    tau_neg: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [T] loss, [T] gate (detached)
    """SAPO's per-token loss ``-gate A`` and its gate."""
    gate = sapo_gate(ratio, advantages, tau_pos=tau_pos, tau_neg=tau_neg)  # [T]
    return -gate * advantages, gate.detach()


def dppo_masks(
    logp: torch.Tensor,  # [T] pi_theta
    *,
    rollout_logp: torch.Tensor,  # [T] mu
    advantages: torch.Tensor,  # [T]
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [T] bool each: dropped for A > 0 (high), dropped for A < 0 (low)
    """DPPO's binary total-variation mask, its two sides apart. A token whose advantage is exactly 0 falls on the
    low side, as in prime-rl's mask ``where(A > 0, high, low)`` (its loss is 0 anyway); prime-rl's metric
    ``is_masked_low`` counts only ``A < 0`` tokens, so rollshard's ``mask/dppo_low`` also counts those."""
    diff = torch.exp(logp.detach()) - torch.exp(rollout_logp)  # [T] p_theta - p_mu
    positive = advantages > 0  # [T]
    return positive & (diff > high), ~positive & (diff < -low)


def opsm_keep(
    logp: torch.Tensor,  # [T] pi_theta
    *,
    rollout_logp: torch.Tensor,  # [T] mu
    advantages: torch.Tensor,  # [T]
    mask: torch.Tensor,  # [T] float
    cu_seqlens: torch.Tensor,  # [S+1]
    delta: float,
) -> torch.Tensor:  # [T] bool
    """OPSM: False on every token of a sequence with a negative advantage whose mean ``log mu - log pi_theta``
    over its loss tokens exceeds ``delta``."""
    gap = segment_mean(rollout_logp - logp.detach(), mask, cu_seqlens)  # [S]
    return ~((advantages < 0) & (gap > delta)[sequence_ids(cu_seqlens)])


def m2po_keep(
    log_w: torch.Tensor,  # [T] log pi_prox - log mu
    mask: torch.Tensor,  # [T] float
    *,
    tau: float,
) -> torch.Tensor:  # [T] bool
    """M2PO: the loss tokens kept once the largest ``log_w^2`` are dropped so that the second moment of the rest
    is below ``tau`` (tokens off the mask are kept: they carry no loss)."""
    on = torch.nonzero(mask > 0).flatten()  # [K]
    keep = torch.ones_like(log_w, dtype=torch.bool)  # [T]
    if on.numel() == 0:
        return keep
    m2 = log_w.detach().index_select(0, on).square()  # [K]
    order = torch.argsort(m2, descending=True, stable=True)  # [K]
    sorted_m2 = m2[order]  # [K] largest first
    counts = torch.arange(m2.numel(), 0, -1, device=m2.device, dtype=m2.dtype)  # [K] tokens left from i on
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / counts  # [K] mean of sorted_m2[i:]
    below = torch.nonzero(suffix_mean < tau).flatten()
    dropped = int(below[0]) if below.numel() else m2.numel() - 1  # never every token: the smallest stays
    keep[on[order[:dropped]]] = False
    return keep


def geo_rs_keep(
    log_w: torch.Tensor,  # [T] log pi_prox - log mu
    mask: torch.Tensor,  # [T] float
    cu_seqlens: torch.Tensor,  # [S+1]
    *,
    low: float,
    high: float,
) -> torch.Tensor:  # [T] bool
    """Geo-RS: keep a sequence whose geometric-mean ratio ``exp(mean_t log_w)`` lies in ``[low, high]``."""
    log_geo = segment_mean(log_w.detach(), mask, cu_seqlens)  # [S]
    kept = (log_geo >= math.log(low)) & (log_geo <= math.log(high))  # [S]
    return kept[sequence_ids(cu_seqlens)]


def k3_rs_keep(
    log_w: torch.Tensor,  # [T] log pi_prox - log mu, clamped
    mask: torch.Tensor,  # [T] float
    cu_seqlens: torch.Tensor,  # [S+1]
    *,
    threshold: float,
    reduce: str = "mean",
) -> torch.Tensor:  # [T] bool
    """K3-RS: keep a sequence whose mean (or sum) of ``rho - 1 - log rho`` over its loss tokens is at most
    ``threshold``."""
    lw = log_w.detach()
    k3 = torch.expm1(lw) - lw  # [T] rho - 1 - log rho >= 0
    if reduce == "mean":
        stat = segment_mean(k3, mask, cu_seqlens)  # [S]
    elif reduce == "sum":
        stat = segment_sum(k3 * mask, cu_seqlens)  # [S]
    else:
        raise ValueError(f"unknown K3-RS reduction {reduce!r}; use mean or sum")
    return (stat <= threshold)[sequence_ids(cu_seqlens)]


# -- the audit's counterfactual ----------------------------------------------------------------------------------

# What `rollshard-train audit` counts for a correction that is off in the config it is given: the peers' defaults
# (slime --opsm-delta, AReaL's M2PO example, verl's Geo-RS and K3-RS presets; IcePop's token band as TRL documents
# it, token_mask with clip 0.5 / 5; TRL's default vLLM correction, sequence_mask capped at 3).
AUDIT_DEFAULTS: dict[str, object] = {"opsm_delta": 1e-4, "m2po_tau": 0.04, "geo_rs": (0.999, 1.001), "k3_rs": 0.01}
ICEPOP_BAND = (0.5, 5.0)
SEQUENCE_MASK_CAP = 3.0
# SAPO has no mask: the audit counts the tokens whose gradient its gate scales below this share of the plain
# policy gradient's (d/dlogp of the gated loss is 4 s (1 - s) r A against r A, s = sigmoid(tau (r - 1))).
SAPO_DAMPED_BELOW = 0.5


def counterfactual(
    logp: torch.Tensor,  # [T] the audited policy, no grad
    *,
    rollout_logp: torch.Tensor,  # [T] mu
    advantages: torch.Tensor,  # [T]
    mask: torch.Tensor,  # [T] float
    cu_seqlens: torch.Tensor,  # [S+1]
    config: LossConfig,  # the parameters of each correction (AUDIT_DEFAULTS for those it leaves off)
    log_ratio_clamp: float,
) -> dict[str, tuple[str, torch.Tensor]]:  # name -> (its parameters in words, [T] bool: tokens it would change)
    """Per correction, the loss tokens it would mask, clip or damp if the audited policy took its first step on
    these rows now: every ratio is ``pi / mu`` (at the first step the proximal policy is the audited one)."""
    A, on = advantages, mask > 0  # [T]
    lw = (logp - rollout_logp).clamp(-log_ratio_clamp, log_ratio_clamp)  # [T] log pi / mu
    r = torch.exp(lw)  # [T]
    cfg = {k: getattr(config, k) if getattr(config, k) is not None else v for k, v in AUDIT_DEFAULTS.items()}
    eps_low, eps_high = config.clip_range()
    c_low, c_high = CISPO_EPS_DEFAULTS
    seq_lw = segment_sum(lw * mask, cu_seqlens).clamp(-log_ratio_clamp, log_ratio_clamp)  # [S] log of the product
    seq_w = torch.exp(seq_lw)[sequence_ids(cu_seqlens)]  # [T]
    s = torch.sigmoid(torch.where(A > 0, config.sapo_tau_pos, config.sapo_tau_neg) * (r - 1.0))  # [T]
    dppo_high, dppo_low = dppo_masks(
        logp, rollout_logp=rollout_logp, advantages=A, low=config.dppo_mask_low, high=config.dppo_mask_high
    )
    lo, hi = cfg["geo_rs"]
    out: dict[str, tuple[str, torch.Tensor]] = {
        "ppo clip": (f"eps {eps_low:g} / {eps_high:g}", ((A > 0) & (r > 1 + eps_high)) | ((A < 0) & (r < 1 - eps_low))),
        **({"dual clip": (f"c {config.dual_clip_c:g}", (A < 0) & (r > config.dual_clip_c))}
           if config.dual_clip_c is not None else {}),
        "cispo": (f"cap {1 + c_high:g}", (r > 1 + c_high) | (r < 1 - c_low)),
        "sapo": (f"tau {config.sapo_tau_pos:g} / {config.sapo_tau_neg:g}, gradient < {SAPO_DAMPED_BELOW:g}x",
                 (A != 0) & (4 * s * (1 - s) < SAPO_DAMPED_BELOW)),
        "dppo": (f"|p - p_mu| {config.dppo_mask_low:g} / {config.dppo_mask_high:g}", dppo_high | dppo_low),
        "tis": (f"C {config.tis_c:g}", r > config.tis_c),
        "icepop": (f"token [{ICEPOP_BAND[0]:g}, {ICEPOP_BAND[1]:g}]", (r < ICEPOP_BAND[0]) | (r > ICEPOP_BAND[1])),
        "sequence mask": (f"sequence > {SEQUENCE_MASK_CAP:g}", seq_w > SEQUENCE_MASK_CAP),
        "opsm": (f"delta {cfg['opsm_delta']:g}",
                 ~opsm_keep(logp, rollout_logp=rollout_logp, advantages=A, mask=mask, cu_seqlens=cu_seqlens,
                            delta=cfg["opsm_delta"])),
        "m2po": (f"tau {cfg['m2po_tau']:g}", ~m2po_keep(lw, mask, tau=cfg["m2po_tau"])),
        "geo-rs": (f"[{lo:g}, {hi:g}]", ~geo_rs_keep(lw, mask, cu_seqlens, low=lo, high=hi)),
        "k3-rs": (f"{config.k3_rs_reduce} {cfg['k3_rs']:g}",
                  ~k3_rs_keep(lw, mask, cu_seqlens, threshold=cfg["k3_rs"], reduce=config.k3_rs_reduce)),
    }
    return {name: (words, hit & on) for name, (words, hit) in out.items()}

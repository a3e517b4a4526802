"""Sampling-aware ratios: the importance ratio over the support the engine sampled from (pure functions).

With top-p / top-k the engine samples token ``y`` from the truncated, renormalized
distribution ``q(y) = pi_rollout(y) / pi_rollout(S)`` over its support ``S``, while
``rollout_logprobs`` hold the full-softmax ``log pi_rollout(y)`` (SGLang's definition).
Without the support, neither ratio a trainer can form is the truncated policy's: its full
softmax against ``log q`` (what an engine returning processed logprobs gives) is off by the
kept mass, ``pi(S) < 1`` at step 0 (TRL #7269: mean 0.896 at top_p 0.8, 1.001 after
renormalizing over the sampled support); against ``rollout_logprobs`` it is 1 at step 0 but
treats the samples as drawn from ``pi_rollout`` rather than ``q``, and once the policy moves
it differs from ``pi(y|S) / q(y)`` by the factor ``pi_rollout(S) / pi(S)``.
Schema 1.1 stores, per response
token, ``S`` and ``log q(y)`` (``sampling_logprobs``); the loader hands them over as
``PackedBatch.has_support / support_ids / support_offsets / sampling_logprobs``.

Definitions, token ``t`` with a support ``S`` and ``LossConfig.renormalize_support`` on
(the default; ``--no-renormalize-support`` turns it off):

* policy side: ``logp_S = logits[y]/T - logsumexp(logits[S]/T)``
  (:class:`rollshard.train.logprobs.SupportLogprobs`), i.e. ``log pi(y | S)``;
* rollout side: the stored ``sampling_logprobs`` ``log q(y)``;
* bypass: ``rho = exp(logp_S - log q)``;
* decoupled: the proximal logprob is renormalized over the same ``S`` (``log pi_prox(y | S)``),
  so ``rho = pi(y|S) / pi_prox(y|S)`` and ``w = pi_prox(y|S) / q(y)``; their product is the
  bypass ratio, as without supports, and at step 0 with one mini-batch ``rho`` is exactly 1
  and ``w`` the bypass ratio (1 up to fp32 rounding). Mixing definitions (a renormalized
  ``w`` with a full-softmax ``rho``) would put the kept-mass bias back into the product.
* KL to the reference: on the full distributions, ``log pi(y) - log pi_ref(y)``, as verl and
  slime compute it. The KL regularizes the model itself, on which the engine truncates afresh
  every step (its supports are a function of the full distribution); the renormalized
  policy term gives logits outside ``S`` no gradient at all, the full KL still does; and
  the reference forward needs no supports.
* entropy: of the full distribution (:mod:`rollshard.train.logprobs`).
* a support of one token (greedy rows under ``--sampling-support on``, ``--top-k 1``): ``logp_S`` is exactly
  0, so such a token's ratio is 1 and it gets no policy gradient, as the truncated policy cannot move there;
  with ``--no-renormalize-support`` it is trained on its full-softmax logprob as before.

Tokens without a support (rows of 1.0 data, untruncated rows, mask-0 positions) keep
today's definitions: full ``logp`` against ``rollout_logprobs``. With the feature off the
full-softmax ratio against ``rollout_logprobs`` is used everywhere; the support metrics
are still reported when the data has supports (the forward computes them from the same
logits block at the cost of a gather).

Metrics (:func:`support_metrics`; means over the tokens named, combined across
micro-batches and ranks by :class:`rollshard.train.metrics.MetricAccumulator`):

* ``ratio/mean``, ``mismatch/*`` (:mod:`rollshard.train.losses`): of the ratio the loss used;
* ``ratio/unrenormalized_mean``: over all loss tokens, ``exp(logp - old)`` against the same
  rollout side ``old`` as the ratio used, the policy side *not* renormalized: on supported
  tokens ``pi(y) / q(y)``, which is ``pi(S)`` at step 0 (TRL #7269's biased ratio); equal to
  ``ratio/mean`` in bypass mode with the feature off;
* ``support/tokens``: fraction of loss tokens with a support;
* ``support/mass_mean``, ``support/mass_min``: the trainer's ``pi(S)`` on those tokens;
* ``support/ratio_mean``: ``exp(logp_S - log q)`` (1 at step 0);
* ``support/ratio_unrenormalized_mean``: ``exp(logp - log q)`` (``pi(S)`` at step 0);
* ``support/ratio_full_mean``: ``exp(logp - rollout_logp)``, the feature-off ratio on those
  tokens (1 at step 0: ``rollout_logprobs`` are of the full softmax, before truncation; the
  two differ by ``pi_rollout(S) / pi(S)`` once the policy moves);
* ``support/abs_diff_mean``, ``support/abs_diff_max``: ``|logp_S - log q|``.
"""

from __future__ import annotations

import torch

from rollshard.train.logprobs import SupportLogprobs
from rollshard.train.losses import LOG_RATIO_CLAMP


def policy_logprobs(
    logp: torch.Tensor,  # [T] full-softmax logprob (current or proximal policy)
    support: SupportLogprobs | None,
    *,
    renormalize: bool,
) -> torch.Tensor:  # [T]
    """The policy logprob the ratio uses: renormalized over the support where there is one (when on), else ``logp``."""
    if support is None or not renormalize:
        return logp
    return torch.where(support.has_support, support.logp, logp)


def rollout_logprobs(
    rollout_logp: torch.Tensor,  # [T] stored full-softmax engine logprobs
    sampling_logp: torch.Tensor | None,  # [T] stored logprob under the truncated, renormalized distribution
    support: SupportLogprobs | None,
    *,
    renormalize: bool,
) -> torch.Tensor:  # [T]
    """The rollout logprob the ratio uses: the stored sampling logprob where there is a support (when on)."""
    if support is None or not renormalize:
        return rollout_logp
    assert sampling_logp is not None, "a batch with supports carries sampling_logprobs (PackedBatch contract)"
    return torch.where(support.has_support, sampling_logp, rollout_logp)


def support_metrics(
    logp: torch.Tensor,  # [T] full-softmax policy logprob
    *,
    old_logp: torch.Tensor,  # [T] the rollout side the ratio used (rollout_logprobs)
    rollout_logp: torch.Tensor,  # [T] stored full-softmax engine logprobs
    sampling_logp: torch.Tensor | None,  # [T]
    support: SupportLogprobs | None,
    loss_mask: torch.Tensor,  # [T]
) -> dict[str, torch.Tensor]:
    """The module docstring's metrics of one micro-batch; ``support/*`` means are over its supported tokens."""
    on = loss_mask > 0  # [T]
    n = on.sum()
    if int(n) == 0:
        return {}

    def ratio(lr: torch.Tensor) -> torch.Tensor:
        return torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    full = logp.detach()  # [T]
    out = {"ratio/unrenormalized_mean": ratio(full - old_logp)[on].mean()}
    if support is None:
        out["support/tokens"] = torch.zeros((), device=logp.device)
        return out
    has = support.has_support & on  # [T]
    k = has.sum()
    out["support/tokens"] = k.float() / n
    if int(k) == 0:
        return out
    q = sampling_logp[has]  # [k] log q(y)
    diff = support.logp.detach()[has] - q  # [k] log(pi(y|S) / q(y))
    mass = support.mass.detach()[has]  # [k]
    out.update(
        {
            "support/mass_mean": mass.mean(),
            "support/mass_min": mass.min(),
            "support/ratio_mean": ratio(diff).mean(),
            "support/ratio_unrenormalized_mean": ratio(full[has] - q).mean(),
            "support/ratio_full_mean": ratio(full[has] - rollout_logp[has]).mean(),
            "support/abs_diff_mean": diff.abs().mean(),
            "support/abs_diff_max": diff.abs().max(),
        }
    )
    return out

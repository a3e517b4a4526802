"""What ``rollshard-train`` says, in one line each, when a run would train without learning.

* **No learning signal** (before the first step): every group the run trains on has advantage 0 -- two or more
  rows of equal reward (a zero-variance group, :mod:`rollshard.store.format.groups`' definition) or, unless
  ``--drop-zero-variance`` dropped them, one row whose advantage is 0 (``--single-member zero``, or reward 0
  under ``reward``). Every loss and gradient is then 0: the run would go on at loss 0 to its end. The groups
  counted are those the loader keeps by ``--statuses`` and ``--agents`` (before the staleness filter, which
  depends on the step). With ``--drop-zero-variance`` and nothing else left the loader refuses the run
  (no step), as it does for any filter that leaves no step.
* **The step-0 mismatch**: ``|logp - rollout_logp|`` (the ratio's own logprobs, renormalized over a stored
  sampling support where there is one) over the first step's tokens, at the weights before any update, mean and
  max. A fresh run prints it; far above fp32 rounding while the rows name another model than ``--model``
  (:func:`rollshard.store.models.fingerprint.model_fingerprint`, else the recorded path) it warns: the ratios
  start off-policy, and clipping would silence most of the gradient.
"""

from __future__ import annotations

import math
from typing import Any

import polars as pl

from rollshard.store.format.groups import group_flags
from rollshard.store.models.fingerprint import model_fingerprint
from rollshard.store.models.versions import resolve_model_path

# fp32 engines agree with the trainer's recomputation to ~2e-5 nats (measured against SGLang and the embedded
# engine); another model's logprobs differ by tenths of a nat or more. 1e-2 is 500x the first and well under the
# second, so rounding never trips it and a policy that is not the rows' does.
MISMATCH_FAR_NATS = 1e-2

FINITE_REWARD = pl.col("reward").filter(pl.col("reward").is_finite())


def no_signal_warning(
    datasets: list[Any], *, statuses, agents, drop_zero_variance: bool, single_member: str
) -> str | None:
    """The warning of a run whose every group would train at advantage 0 (module docstring); None otherwise."""
    groups = zero = silent_single = 0
    low, high = math.inf, -math.inf
    for ds in datasets:
        lf = ds.scan().select("group_id", "agent", "status", "reward").filter(pl.col("status").is_in(list(statuses)))
        if agents:
            lf = lf.filter(pl.col("agent").is_in(list(agents)))
        per_group = lf.group_by("group_id").agg(*group_flags(), FINITE_REWARD.first().alias("first"))
        silent = pl.col("single_member") & ((pl.col("first") == 0) if single_member == "reward" else pl.lit(True))
        counts, span = pl.collect_all([
            per_group.select(
                pl.len().alias("groups"),
                pl.col("zero_variance").sum().alias("zero"),
                silent.sum().alias("silent_single"),
            ),
            lf.select(FINITE_REWARD.min().alias("low"), FINITE_REWARD.max().alias("high")),
        ])  # fmt: skip
        c, s = counts.row(0, named=True), span.row(0, named=True)
        groups, zero, silent_single = groups + c["groups"], zero + c["zero"], silent_single + c["silent_single"]
        if s["low"] is not None:
            low, high = min(low, s["low"]), max(high, s["high"])
    if drop_zero_variance:  # the loader drops them: what is left is what trains
        groups, zero = groups - zero, 0
    if groups == 0 or zero + silent_single < groups:
        return None
    parts = [f"{zero} have zero reward variance"] if zero else []
    if silent_single:
        parts.append(f"{silent_single} are one row " + ("with reward 0" if single_member == "reward" else
                                                         "(--single-member zero)"))
    equal = f" (every reward is {low:g})" if low == high else ""
    return (
        f"no learning signal: of the {groups} groups in --data, {' and '.join(parts)}{equal}, so every advantage is 0 "
        "and every step's loss and gradient will be 0; check the reward function on a few rows (rollshard-store "
        "inspect), and generate more samples per prompt (--n-samples) or at another temperature (lower where a "
        "model's samples all fail, higher where they all succeed) so a group's rewards can differ"
    )


def recorded_models(datasets: list[Any]) -> list[dict[str, str | None]]:
    """The model each writer of the datasets recorded: its path and fingerprint (None where not recorded)."""
    out = []
    for ds in datasets:
        for m in ds.manifests:
            c = m.config or {}
            if m.shards and (c.get("model") or c.get("model_fingerprint")):
                out.append({"model": c.get("model"), "fingerprint": c.get("model_fingerprint")})
    return out


def another_model(recorded: list[dict[str, str | None]], model: str) -> tuple[dict[str, str | None], str | None] | None:
    """``(the model the rows name, --model's fingerprint)`` when none of the rows' writers recorded ``model`` (a
    resolved local folder); None when one did, or none recorded a model. A writer's fingerprint decides; one
    without it (datasets made before it was recorded) is compared by its resolved path."""
    if not recorded:
        return None
    mine = model_fingerprint(model)
    for r in recorded:
        if r["fingerprint"] is not None:
            if r["fingerprint"] == mine:
                return None
        elif r["model"] and resolve_model_path(r["model"]) == model:
            return None
    return recorded[0], mine


def mismatch_line(tokens: float, mean: float, high: float) -> str:
    return (
        f"step-0 mismatch |logp - rollout_logp| over {tokens:.0f} tokens: mean {mean:.3g}, max {high:.3g} nats (the "
        "policy before any update against the stored rollout logprobs)"
    )


def mismatch_warning(high: float, recorded: list[dict[str, str | None]], model: str) -> str | None:
    """The warning of a step-0 mismatch far above fp32 rounding on rows of another model; None otherwise."""
    if high <= MISMATCH_FAR_NATS:  # NaN goes on: a non-finite mismatch is far from rounding too
        return None
    other = another_model(recorded, model)
    if other is None:
        return None
    theirs, mine = other
    if theirs["fingerprint"] is not None:
        how = f"{theirs['model']}, fingerprint {theirs['fingerprint']}; --model's is {mine}"
    else:
        how = f"{theirs['model']}, by its recorded path"
    return (
        f"step-0 mismatch max {high:.3g} nats is far above fp32 rounding (> {MISMATCH_FAR_NATS:g}) and the rows were "
        f"generated by another model ({how}) than --model {model}: the ratios start off-policy; pass the model "
        "that generated them as --model, or generate the rows with this one"
    )

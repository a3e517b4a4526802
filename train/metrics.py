"""Per-step metrics: combine micro-batches and ranks.

:class:`MetricAccumulator` holds four kinds of entries, each combined the way its
meaning needs: sums (loss terms, already normalized by the global batch of their
mini-batch and weighted by that mini-batch's share of the step, so a step's ``loss/*``
is its loss as one batch whatever ``--mini-batches`` says; counts),
weighted means (per-token statistics, weighted by valid tokens; the ``support/*`` means
of :mod:`rollshard.train.support` by the tokens with a sampling support, ``support/tokens``
times the valid tokens), minima and maxima.
Its state is plain JSON, so data-parallel ranks exchange it without pickle and rank 0
merges them. :func:`loss_metric_kind` maps the names returned by
:func:`rollshard.train.losses.policy_loss` onto these kinds.

:class:`MetricsLogger` (in :mod:`rollshard.train.loggers`, re-exported here with
:func:`read_metrics`) writes each step to ``OUT/metrics.jsonl``, TensorBoard and wandb.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from rollshard.train.loggers import MetricsLogger, read_metrics  # noqa: F401  (re-exported: the trainer's API)


def loss_metric_weight(name: str, metrics: dict[str, Any], weight: float) -> float:
    """The weight of a mean metric of one micro-batch whose valid tokens are ``weight``: the ``support/*`` means
    (other than ``support/tokens``, the fraction itself) are over its tokens with a sampling support."""
    if name.startswith("support/") and name != "support/tokens":
        return weight * float(metrics.get("support/tokens", 0.0))
    return weight


@functools.lru_cache(maxsize=4096)  # a few dozen names, asked for every micro-batch
def loss_metric_kind(name: str) -> str:
    """How a loss metric combines over micro-batches: sum, min, max or mean (token-weighted)."""
    leaf = name.rsplit("/", 1)[-1]
    if name.startswith("loss/") or name == "tokens":
        return "sum"
    if leaf == "min" or leaf.endswith("_min"):
        return "min"
    if leaf == "max" or leaf.endswith("_max"):
        return "max"
    return "mean"


def to_host(metrics: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """0-d tensors of several micro-batches as Python floats, in one device-to-host transfer (one sync) instead
    of one per figure. Exact: the scalars are stacked in their own dtype (float64 when dtypes differ: every
    float32, bfloat16 and integer count below 2**53 is a float64), so each float is the one ``float(t)`` reads."""
    flat = [v for m in metrics for v in m.values()]
    if not flat:
        return [{} for _ in metrics]
    kinds = {(v.dtype, v.device) for v in flat}
    if len(kinds) > 1:
        device = flat[0].device
        flat = [v.to(device, torch.float64) for v in flat]
    values = iter(torch.stack(flat).tolist())
    return [{name: float(next(values)) for name in m} for m in metrics]


class MetricAccumulator:
    """Sums, weighted means, minima and maxima of named scalars."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.means: dict[str, list[float]] = {}  # name -> [weighted sum, weight]
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}

    def add_sum(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def add_mean(self, name: str, value: float, weight: float = 1.0) -> None:
        if weight > 0:
            acc = self.means.setdefault(name, [0.0, 0.0])
            acc[0] += float(value) * weight
            acc[1] += weight

    def add_min(self, name: str, value: float) -> None:
        self.mins[name] = min(self.mins.get(name, math.inf), float(value))

    def add_max(self, name: str, value: float) -> None:
        self.maxs[name] = max(self.maxs.get(name, -math.inf), float(value))

    def add_loss_metrics(self, metrics: dict[str, Any], weight: float, *, loss_share: float = 1.0) -> None:
        """Metrics of one micro-batch from ``policy_loss``, means weighted by ``weight`` (its valid tokens),
        ``loss/*`` terms by ``loss_share`` (its mini-batch's share of the step, ``trainer.loss_shares``)."""
        for name, value in metrics.items():
            v = float(value)
            kind = loss_metric_kind(name)
            if kind == "sum":
                self.add_sum(name, v * loss_share if name.startswith("loss/") else v)
            elif kind == "min":
                self.add_min(name, v)
            elif kind == "max":
                self.add_max(name, v)
            else:
                self.add_mean(name, v, loss_metric_weight(name, metrics, weight))

    def state(self) -> dict[str, Any]:
        return {"sums": self.sums, "means": self.means, "mins": self.mins, "maxs": self.maxs}

    @classmethod
    def merged(cls, states: list[dict[str, Any]]) -> "MetricAccumulator":
        acc = cls()
        for s in states:
            for k, v in s["sums"].items():
                acc.add_sum(k, v)
            for k, (wsum, w) in s["means"].items():
                m = acc.means.setdefault(k, [0.0, 0.0])
                m[0] += wsum
                m[1] += w
            for k, v in s["mins"].items():
                acc.add_min(k, v)
            for k, v in s["maxs"].items():
                acc.add_max(k, v)
        return acc

    def result(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.sums)
        out.update({k: wsum / w for k, (wsum, w) in self.means.items() if w > 0})
        out.update(self.mins)
        out.update(self.maxs)
        return out


def mean_std(total: float, total_sq: float, n: float) -> tuple[float, float]:
    """Mean and population std from a sum, a sum of squares and a count."""
    if n <= 0:
        return 0.0, 0.0
    mean = total / n
    return mean, math.sqrt(max(total_sq / n - mean * mean, 0.0))

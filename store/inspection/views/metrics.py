"""A training run's ``metrics.jsonl`` (one JSON object per step, as ``rollshard-train`` writes it): read it,
group its keys into panels, and plot them. :func:`read_metrics_lines` is the one reader of the file's lines,
for these views and for the trainer (its ``--resume`` keeps the lines up to the checkpoint's step).

Read defensively: an unfinished last line is a step being written (skipped); the trainer writes
non-finite values as the strings ``"nan"``/``"inf"``; text values are not metrics. A metric that is 0 at
every logged step draws a flat line and says nothing: such metrics get no panel, and are listed by
name instead. Throughput's first step includes compilation and warm-up, and one slow step can dwarf
the rest: its panel takes robust y-limits (:func:`robust_limits`), draws a rolling median over the raw
values, marks points off the scale at its edge, and marks the first step.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from rollshard.store.inspection.views.figures import legend_outside, new_figure

NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "infinity": math.inf, "-infinity": -math.inf}
NOT_METRICS = {"step", "time"}  # the x axis and the wall clock
AGENT_REWARD = re.compile(r"^reward/(mean/[^/]+|[^/]+/mean)$")
ROBUST_WHISKER = 3.0  # y-limits at most this many IQRs beyond the quartiles (Tukey's far-out fence)
ROLLING = 5  # steps in the throughput's rolling median

# (title, y label, candidate keys, reference line, robust y-limits). Candidates cover the names in the
# project's docs and the trainer's own; a panel draws whichever are present.
PANELS: list[tuple[str, str, list[str], float | None, bool]] = [
    ("Loss", "loss", ["loss", "loss/total", "loss/policy"], None, False),
    ("Reward", "mean reward", ["reward/mean"], None, False),
    ("Importance ratio exp(logp - logp_rollout)", "ratio", ["ratio/mean", "ratio/min", "ratio/max"], 1.0, False),
    ("Clipped fraction", "fraction of tokens",
     ["clip_frac", "clip_frac/low", "clip_frac/high", "clip/frac_low", "clip/frac_high", "clip/frac_dual"], None, False),
    ("Train-rollout mismatch |logp - logp_rollout|", "nats",
     ["mismatch/abs_mean", "mismatch/abs_max", "mismatch/abs_diff_mean", "mismatch/abs_diff_max"], None, False),
    ("KL (k3 estimator)", "KL", ["kl/k3", "mismatch/k3_kl", "loss/kl"], None, False),
    ("Effective sample size (normalized)", "ESS", ["is/ess"], 1.0, False),
    ("Importance weights", "weight", ["is/mean", "is/min", "is/max", "is/frac_dropped"], 1.0, False),
    ("Learning rate", "lr", ["lr", "optim/lr"], None, False),
    ("Gradient norm", "grad norm", ["grad_norm", "optim/grad_norm", "optim/grad_norm_max"], None, False),
    ("Staleness (policy versions behind)", "versions", ["staleness/mean", "staleness/max"], None, False),
    ("Groups without signal", "fraction of groups", ["groups/frac_zero_variance", "groups/frac_single"], None, False),
    ("Throughput", "tokens / s", ["tokens_per_s", "perf/tokens_per_s"], None, True),
]


class MetricsError(ValueError):
    """A metrics file that is not JSON lines."""


@dataclass(frozen=True)
class MetricsLines:
    """The complete lines of a ``metrics.jsonl`` in file order, each as written and as parsed."""

    lines: list[str]  # each non-blank line as written, without its newline
    values: list[Any]  # each line's JSON value (a step's record: a JSON object)
    torn_last_line: bool  # the last line was not JSON (a step being written, or a kill mid-write): left out


def read_metrics_lines(path: str | os.PathLike) -> MetricsLines:
    """Every complete line of a ``metrics.jsonl``. Only its last line can be cut short (the trainer flushes each
    line whole, so a kill tears the last one at most): a last line that is not JSON is left out; any other raises
    :class:`MetricsError` naming it. OSError when the file cannot be read."""
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    values = []
    for i, line in enumerate(lines):
        try:
            values.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                return MetricsLines(lines[:-1], values, torn_last_line=True)
            raise MetricsError(f"{path}:{i + 1}: not JSON ({e.msg}); repair or delete that line (is this a "
                               "rollshard-train metrics.jsonl?)") from e
    return MetricsLines(lines, values, torn_last_line=False)


def number(v: Any) -> float | None:
    """A metric value as a float; None for text and anything else that is not a number."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        return NON_FINITE.get(v.strip().lower())
    return None


@dataclass
class Metrics:
    frame: pl.DataFrame  # one Float64 column per numeric key, "step" first
    keys: list[str]  # numeric keys, sorted
    skipped_last_line: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return self.frame.height


def read_metrics(path: str) -> Metrics:
    """JSON lines -> one row per step; an unparsable last line is a step being written, any other an error."""
    try:
        read = read_metrics_lines(path)
    except OSError as e:
        raise MetricsError(f"cannot read metrics file {path}: {e.strerror or e}") from e
    records, skipped = [rec for rec in read.values if isinstance(rec, dict)], read.torn_last_line
    if not records:
        raise MetricsError(f"{path}: no metrics (no JSON object per line); is this a rollshard-train metrics.jsonl?")
    keys = sorted({k for r in records for k, v in r.items() if number(v) is not None})
    frame = pl.DataFrame([{k: number(r.get(k)) for k in keys} for r in records], schema={k: pl.Float64 for k in keys})
    if "step" not in keys:  # no step column: the line number is the step
        frame = frame.with_row_index("step", offset=1).with_columns(pl.col("step").cast(pl.Float64))
    frame = frame.select("step", *[k for k in keys if k != "step"])
    return Metrics(frame, keys, skipped)


def logged(m: Metrics, key: str) -> pl.Series:
    return m.frame[key].drop_nulls().drop_nans()


def summary(m: Metrics) -> pl.DataFrame:
    """Last value, min and max of every metric (NaN and missing steps left out)."""
    rows = []
    for k in m.keys:
        if k in NOT_METRICS:
            continue
        s = logged(m, k)
        rows.append({"metric": k, "last": s[-1] if s.len() else None, "min": s.min(), "max": s.max(),
                     "steps logged": s.len()})
    schema = {"metric": pl.String, "last": pl.Float64, "min": pl.Float64, "max": pl.Float64, "steps logged": pl.Int64}
    return pl.DataFrame(rows, schema=schema)


def constant_zero(m: Metrics) -> list[str]:
    """Metrics whose every finite logged value is 0 (and that have one)."""
    out = []
    for k in m.keys:
        if k in NOT_METRICS:
            continue
        s = m.frame[k].drop_nulls()
        finite = s.filter(s.is_finite())
        if finite.len() and finite.len() == s.len() and bool((finite == 0).all()):
            out.append(k)
    return out


def panels(m: Metrics) -> list[tuple[str, str, list[str], float | None, bool]]:
    """The panels with at least one key present and not constant zero."""
    zero = set(constant_zero(m))
    agent_rewards = [k for k in m.keys if AGENT_REWARD.match(k) and k != "reward/mean"]
    out = []
    for title, ylabel, keys, ref, robust in PANELS:
        keys = keys + agent_rewards if title == "Reward" else keys
        present = [k for k in keys if k in m.keys and k not in zero]
        if present:
            out.append((title, ylabel, present, ref, robust))
    return out


def other_keys(m: Metrics) -> list[str]:
    """Numeric keys in no panel, not histogram buckets, not constant zero."""
    plotted = {k for p in panels(m) for k in p[2]} | NOT_METRICS | set(constant_zero(m))
    return [k for k in m.keys if k not in plotted and "/hist/" not in k]


def robust_limits(values, whisker: float = ROBUST_WHISKER, skip_first: bool = True) -> tuple[float, float]:
    """Y-limits that keep the bulk of ``values`` readable: the data's range cut at ``whisker`` IQRs beyond the
    quartiles, padded by 5%. ``skip_first`` leaves the first value (a compile/warm-up step) out of the fit."""
    y = np.asarray(values, float)
    y = y[1:] if skip_first and len(y) > 2 else y
    y = y[np.isfinite(y)]
    if not len(y):
        return (0.0, 1.0)
    q1, q3 = np.percentile(y, [25, 75])
    iqr = q3 - q1
    lo, hi = max(float(y.min()), q1 - whisker * iqr), min(float(y.max()), q3 + whisker * iqr)
    pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
    return (lo - pad, hi + pad)


def rolling_median(values, window: int = ROLLING) -> np.ndarray:
    """Centered rolling median (NaN ignored; shorter windows at the ends)."""
    return pl.Series(np.asarray(values, float)).fill_nan(None).rolling_median(
        window, min_samples=1, center=True).to_numpy()


def _draw(ax, m: Metrics, key: str, robust: bool = False) -> None:
    d = m.frame.select("step", key).drop_nulls()
    bad = d.filter(~pl.col(key).is_finite())["step"].to_numpy()  # diverged steps: a red dotted line each
    for i, s in enumerate(bad):
        ax.axvline(s, color="red", linestyle=":", linewidth=1, label=f"{key} not finite" if i == 0 else None)
    d = d.filter(pl.col(key).is_finite())
    x, y = d["step"].to_numpy(), d[key].to_numpy()
    if not robust:
        ax.plot(x, y, marker="." if len(x) < 60 else None, label=key)
        return
    line, = ax.plot(x, y, marker=".", linewidth=0.8, alpha=0.45, label=f"{key} (each step)")
    ax.plot(x, rolling_median(y), color=line.get_color(), linewidth=2.2, label=f"rolling median ({ROLLING} steps)")
    lo, hi = robust_limits(y)
    ax.set_ylim(lo, hi)
    out_hi, out_lo = y > hi, y < lo
    if out_hi.any():
        ax.plot(x[out_hi], np.full(out_hi.sum(), hi), "^", color="tab:red", clip_on=False,
                label=f"off scale ({int(out_hi.sum())}): max {y.max():,.0f}")
    if out_lo.any():
        ax.plot(x[out_lo], np.full(out_lo.sum(), lo), "v", color="tab:red", clip_on=False,
                label=f"off scale ({int(out_lo.sum())}): min {y.min():,.0f}")
    if len(x):
        ax.axvline(x[0], color="grey", linestyle=":", linewidth=1.2)
        ax.annotate("first step\n(compile, warm-up)", (x[0], 1.0), xycoords=("data", "axes fraction"),
                    xytext=(4, -4), textcoords="offset points", va="top", fontsize=7, color="grey")


def panels_figure(m: Metrics, cols: int = 3):
    """The standard panels in a grid (None when the file has none of their keys)."""
    ps = panels(m)
    if not ps:
        return None
    rows = math.ceil(len(ps) / cols)
    fig = new_figure(6.0 * cols, 3.3 * rows)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)  # a list: zip() takes one more from an iterator
    for ax, (title, ylabel, present, ref, robust) in zip(axes, ps):
        for k in present:
            _draw(ax, m, k, robust)
        if ref is not None:
            ax.axhline(ref, color="grey", linestyle="--", linewidth=1, label=f"{ref:g}")
        if title == "Learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.legend(fontsize=7, loc="best")
    for ax in axes[len(ps):]:
        ax.set_visible(False)
    return fig


def others_figure(m: Metrics, cols: int = 4):
    keys = other_keys(m)
    if not keys:
        return None
    rows = math.ceil(len(keys) / cols)
    fig = new_figure(4.2 * cols, 2.8 * rows)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax, k in zip(axes, keys):
        _draw(ax, m, k)
        ax.set(title=k, xlabel="step", ylabel=k.rsplit("/", 1)[-1])
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    return fig


def staleness_buckets(m: Metrics) -> list[str]:
    """``staleness/hist/N`` keys, N ascending (numbers as numbers)."""
    prefix = "staleness/hist/"
    keys = [k for k in m.keys if k.startswith(prefix)]
    return sorted(keys, key=lambda k: (not k[len(prefix):].lstrip("-").isdigit(),
                                       int(k[len(prefix):]) if k[len(prefix):].lstrip("-").isdigit() else 0, k))


def staleness_figure(m: Metrics):
    """Rows per step by how many policy versions behind they were generated: stacked bars, one per step."""
    hist = staleness_buckets(m)
    if not hist:
        return None
    d = m.frame.select("step", *hist).fill_null(0.0).fill_nan(0.0)
    from rollshard.store.inspection.views.figures import mpl

    colors = mpl().colormaps["viridis"](np.linspace(0, 0.9, len(hist)))
    fig = new_figure(11, 3.6)
    ax = fig.subplots()
    x, bottom = d["step"].to_numpy(), np.zeros(d.height)
    for k, c in zip(hist, colors):
        y = d[k].to_numpy()
        ax.bar(x, y, width=0.85, bottom=bottom, color=c, label=k.rsplit("/", 1)[1])
        bottom += y
    ax.set(title="Rows per step by staleness (stacked)", xlabel="step", ylabel="rows")
    # One column per 10 buckets: a run of many steps over one round's rows reaches tens of versions behind, and
    # one column of them would be taller than the figure.
    legend_outside(ax, title="versions behind", ncol=-(-len(hist) // 10))
    return fig

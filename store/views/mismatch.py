"""Views of the per-token audit report (:mod:`rollshard.store.audit`): its summary as tables, the worst
trajectory (the one holding the token of largest ``|trainer_logprob - rollout_logprob|``) and its tokens.

The numbers are :func:`rollshard.store.audit.summarize`'s and :func:`~rollshard.store.audit.worst_tokens`'s,
so the report, ``inspect --sample worst-mismatch`` and ``rollshard-train audit`` agree.
"""

from __future__ import annotations

from typing import Any

import polars as pl
import pyarrow as pa

from rollshard.store.audit import STAT_KEYS, per_token, read_audit, summarize, worst_tokens

GROUP_TITLES = {
    "by_agent": "agent",
    "by_weight_version": "weight_version",
    "by_position": "response position",
    "by_temperature": "temperature",
    "by_source": "source",
}


def load(path: str) -> pa.Table:
    """The audit report at ``path`` (one-line :class:`~rollshard.store.audit.AuditSchemaError` if it is not one)."""
    return read_audit(path)


def summary_frames(report: pa.Table) -> tuple[dict[str, Any], dict[str, pl.DataFrame]]:
    """The summary, and one table per group (``overall`` first) with a row per label."""
    s = summarize(report)
    frames = {"overall": pl.DataFrame([{"": "all tokens", **s["overall"]}])}
    for key, title in GROUP_TITLES.items():
        rows = [{title: label, **stats} for label, stats in s.get(key, {}).items()]
        if rows:
            frames[key] = pl.DataFrame(rows).select(title, *STAT_KEYS)
    return s, frames


def worst_sample(report: pa.Table) -> str | None:
    """The sample holding the report's token of largest |r| (ties as :func:`worst_tokens` breaks them)."""
    w = worst_tokens(report, 1)
    return w["sample_id"][0] if w.height else None


def sample_tokens(report: pa.Table, sample_id: str) -> pl.DataFrame:
    """The audited tokens of one sample, by position, with ``diff`` and ``abs_diff`` (:func:`per_token`)."""
    df = pl.from_arrow(report).filter(pl.col("sample_id") == sample_id)
    return per_token(df).sort("position")

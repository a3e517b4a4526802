"""Views of the per-token audit report (:mod:`rollshard.store.inspection.audit`): its summary as tables, the worst
trajectory (the one holding the token of largest ``|trainer_logprob - rollout_logprob|``) and its tokens, and
which of the given datasets the report's rows are from (:func:`pair`).

Sample ids repeat across datasets (every round of rollshard-loop reuses the prompt ids), so a token is paired
with its row by (dataset, sample_id): its ``source``'s dataset, the one whose fingerprint the report names. A
report of audit schema 1.0 names none: its rows are matched by sample_id alone, newest dataset first, with
:data:`UNPAIRED` said as a warning.

The numbers are :func:`rollshard.store.inspection.audit.summarize`'s and :func:`~rollshard.store.inspection.audit.worst_tokens`'s,
so the report, ``inspect --sample worst-mismatch`` and ``rollshard-train audit`` agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from rollshard.store.inspection.audit import (STAT_KEYS, AuditedDataset, audited_datasets, per_token, read_audit, summarize,
                                   worst_tokens)
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.inspection.stats import find_sample

GROUP_TITLES = {
    "by_agent": "agent",
    "by_weight_version": "weight_version",
    "by_position": "response position",
    "by_temperature": "temperature",
    "by_source": "source",
}
UNPAIRED = ("names no audited dataset (an audit report of schema 1.0): its rows are matched by sample_id alone, "
            "newest dataset first, and ids repeat across rounds; re-run rollshard-train audit to pair them by dataset")


class AuditDatasetError(ValueError):
    """An audit report of none of the datasets given."""


def load(path: str) -> pa.Table:
    """The audit report at ``path`` (one-line :class:`~rollshard.store.inspection.audit.AuditSchemaError` if it is not one)."""
    return read_audit(path)


@dataclass(frozen=True)
class Pairing:
    """Which of the given datasets each source of an audit report is."""

    audited: list[AuditedDataset] | None  # what the report names; None: a report of schema 1.0
    datasets: dict[str, RolloutDataset]  # source -> the given dataset it is (the paired sources only)
    opened: Sequence[RolloutDataset]

    def tokens(self, report: pa.Table) -> pa.Table:
        """The report's tokens of the paired sources (every token of a 1.0 report)."""
        if self.audited is None:
            return report
        return report.filter(pc.is_in(report["source"], pa.array(sorted(self.datasets), pa.string())))

    def find_row(self, source: str, sample_id: str) -> tuple[RolloutDataset | None, dict[str, Any] | None]:
        """The dataset and row of a token of ``source``; (None, None) when it is not there."""
        if self.audited is not None:
            ds = self.datasets.get(source)
            return (ds, find_sample(ds, sample_id)) if ds is not None else (None, None)
        for ds in reversed(self.opened):
            row = find_sample(ds, sample_id)
            if row is not None:
                return ds, row
        return None, None

    def sources_of(self, ds: RolloutDataset) -> list[str]:
        """The report's sources paired with ``ds`` (none for a 1.0 report)."""
        return sorted(s for s, d in self.datasets.items() if d is ds)

    def describe(self) -> str:
        """What the report says it audited, as text."""
        if self.audited is None:
            return "the datasets it was made of are not recorded"
        return "audit of " + ", ".join(f"{a.source} = {a}" if a.source != a.uri else str(a) for a in self.audited)


def pair(report: pa.Table, opened: Sequence[RolloutDataset], *, audit: str) -> Pairing:
    """Pair each source the report names with the given dataset of its fingerprint (a later one wins when two
    are equal); :class:`AuditDatasetError` (one line) when the report is of none of them."""
    audited = audited_datasets(report)
    if audited is None:
        return Pairing(audited=None, datasets={}, opened=opened)
    by_fingerprint = {ds.fingerprint: ds for ds in opened}
    datasets = {a.source: by_fingerprint[a.fingerprint] for a in audited if a.fingerprint in by_fingerprint}
    if not datasets:
        given = [AuditedDataset.of("", ds) for ds in opened]
        changed = [g.uri for g in given if any(a.uri == g.uri for a in audited)]
        since = f" ({', '.join(changed)} changed since the audit)" if changed else ""
        raise AuditDatasetError(
            f"{audit}: the audit is of {', '.join(map(str, audited))}, not of {', '.join(map(str, given))}{since}; "
            f"pass that dataset or re-run rollshard-train audit --data {','.join(g.uri for g in given)}")
    return Pairing(audited=audited, datasets=datasets, opened=opened)


def summary_frames(report: pa.Table) -> tuple[dict[str, Any], dict[str, pl.DataFrame]]:
    """The summary, and one table per group (``overall`` first) with a row per label."""
    s = summarize(report)
    frames = {"overall": pl.DataFrame([{"": "all tokens", **s["overall"]}])}
    for key, title in GROUP_TITLES.items():
        rows = [{title: label, **stats} for label, stats in s.get(key, {}).items()]
        if rows:
            frames[key] = pl.DataFrame(rows).select(title, *STAT_KEYS)
    return s, frames


def worst_sample(report: pa.Table) -> tuple[str, str] | None:
    """``(source, sample_id)`` of the report's token of largest |r| (ties as :func:`worst_tokens` breaks them)."""
    w = worst_tokens(report, 1)
    return (w["source"][0], w["sample_id"][0]) if w.height else None


def sample_tokens(report: pa.Table, sample_id: str, source: str | None = None) -> pl.DataFrame:
    """The audited tokens of one sample (of ``source``; of any, without it), by position, with ``diff`` and
    ``abs_diff`` (:func:`per_token`)."""
    df = pl.from_arrow(report).filter(pl.col("sample_id") == sample_id)
    if source is not None:
        df = df.filter(pl.col("source") == source)
    return per_token(df).sort("position")


"""Row filters over a dataset, written as a derived dataset: ``rollshard-store filter``.

A :class:`RowFilter` keeps a row when every filter given passes (filters not given pass):

* ``agents``: ``agent`` is one of them;
* ``statuses``: ``status`` is one of them;
* ``min_reward`` / ``max_reward``: ``reward`` is finite and ``>= min_reward`` / ``<= max_reward``
  (a row without a reward, a failed one, is dropped by either);
* ``weight_versions``: ``weight_version`` is one of these strings; or ``weight_version_range``
  ``(lo, hi)``: it is an integer with ``lo <= v <= hi`` (either bound None: open), rows whose
  version is not an integer are dropped;
* ``sample_ids``: ``sample_id`` is in the set.

Filters are per row: a reward range can keep part of a GRPO group (the trainer then
normalizes the rows left); a group is never split across shards. :func:`filter_dataset`
runs the filter through :func:`rollshard.store.derived.derive.derive_dataset`, so shards whose rows
all pass are copied byte for byte, the others rewritten, and the lineage records
:meth:`RowFilter.details`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.derived.derive import DeriveResult, derive_dataset
from rollshard.store.format.schema import STATUS_VALUES

OPERATION = "filter"
INT_VERSION = r"^-?[0-9]{1,18}$"  # an integer version that fits int64


@dataclasses.dataclass(kw_only=True, frozen=True)
class RowFilter:
    """Which rows to keep (module docstring); at least one filter must be given."""

    agents: tuple[str, ...] | None = None
    statuses: tuple[str, ...] | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    weight_versions: tuple[str, ...] | None = None
    weight_version_range: tuple[int | None, int | None] | None = None  # inclusive
    sample_ids: frozenset[str] | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        if not given:
            raise ValueError("no filter given; pass at least one of --agent, --status, --min-reward, --max-reward, "
                             "--weight-version, --sample-ids")
        for name in ("agents", "statuses", "weight_versions"):
            values = getattr(self, name)
            if values is not None and (not values or any(not v for v in values)):
                raise ValueError(f"{name} must list one or more non-empty values; got {list(values)}")
        bad = sorted(set(self.statuses or ()) - set(STATUS_VALUES))
        if bad:
            raise ValueError(f"status {bad[0]!r} is not one of {', '.join(STATUS_VALUES)}")
        for name in ("min_reward", "max_reward"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number; got {v}")
        if self.min_reward is not None and self.max_reward is not None and self.min_reward > self.max_reward:
            raise ValueError(f"min_reward {self.min_reward} is above max_reward {self.max_reward}: no row could pass")
        if self.weight_versions is not None and self.weight_version_range is not None:
            raise ValueError("give weight versions as a list or as a range, not both")
        if self.weight_version_range is not None:
            lo, hi = self.weight_version_range
            if lo is None and hi is None:
                raise ValueError("a weight version range needs a bound: LO..HI, LO.. or ..HI")
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"weight version range {lo}..{hi} is empty (LO is above HI)")

    def mask(self, table: pa.Table) -> pa.ChunkedArray:
        """``[rows]`` True where a row passes every filter given (a null compares as False)."""
        conds = []
        if self.agents is not None:
            conds.append(pc.is_in(table["agent"], value_set=pa.array(self.agents, pa.string())))
        if self.statuses is not None:
            conds.append(pc.is_in(table["status"], value_set=pa.array(self.statuses, pa.string())))
        if self.min_reward is not None:
            conds.append(pc.greater_equal(table["reward"], pa.scalar(self.min_reward, pa.float64())))
        if self.max_reward is not None:
            conds.append(pc.less_equal(table["reward"], pa.scalar(self.max_reward, pa.float64())))
        if self.min_reward is not None or self.max_reward is not None:
            conds.append(pc.is_finite(table["reward"]))
        if self.weight_versions is not None:
            conds.append(pc.is_in(table["weight_version"], value_set=pa.array(self.weight_versions, pa.string())))
        if self.weight_version_range is not None:
            conds.append(_in_range(table["weight_version"], *self.weight_version_range))
        if self.sample_ids is not None:
            conds.append(pc.is_in(table["sample_id"], value_set=pa.array(sorted(self.sample_ids), pa.string())))
        keep = pc.fill_null(conds[0], False)  # __post_init__: at least one filter
        for c in conds[1:]:
            keep = pc.and_(keep, pc.fill_null(c, False))
        return keep

    def __call__(self, table: pa.Table) -> pa.Table:
        """The derive transform: the rows that pass (``table`` itself when all do)."""
        keep = self.mask(table)
        return table if pc.all(keep).as_py() is not False else table.filter(keep)

    def details(self) -> dict[str, Any]:
        """What the lineage records: the filters given, and the expression they make."""
        filters: dict[str, Any] = {}
        if self.agents is not None:
            filters["agent"] = sorted(self.agents)
        if self.statuses is not None:
            filters["status"] = sorted(self.statuses)
        if self.min_reward is not None:
            filters["min_reward"] = self.min_reward
        if self.max_reward is not None:
            filters["max_reward"] = self.max_reward
        if self.weight_versions is not None:
            filters["weight_version"] = sorted(self.weight_versions)
        if self.weight_version_range is not None:
            filters["weight_version_range"] = list(self.weight_version_range)
        if self.sample_ids is not None:
            digest = hashlib.sha256("\n".join(sorted(self.sample_ids)).encode()).hexdigest()[:16]
            filters["sample_ids"] = {"count": len(self.sample_ids), "sha256": digest}
        return {"filters": filters, "expression": self.expression()}

    def expression(self) -> str:
        """The filter as one line: ``agent in [solver] and reward >= 0.5``."""
        parts = []
        if self.agents is not None:
            parts.append(f"agent in [{', '.join(sorted(self.agents))}]")
        if self.statuses is not None:
            parts.append(f"status in [{', '.join(sorted(self.statuses))}]")
        if self.min_reward is not None:
            parts.append(f"reward >= {self.min_reward:g}")
        if self.max_reward is not None:
            parts.append(f"reward <= {self.max_reward:g}")
        if self.weight_versions is not None:
            parts.append(f"weight_version in [{', '.join(sorted(self.weight_versions))}]")
        if self.weight_version_range is not None:
            lo, hi = self.weight_version_range
            bounds = (f"weight_version >= {lo}" if lo is not None else "",
                      f"weight_version <= {hi}" if hi is not None else "")
            parts.append(" and ".join(b for b in bounds if b))
        if self.sample_ids is not None:
            parts.append(f"sample_id in ({len(self.sample_ids):,} ids)")
        return " and ".join(parts)


def filter_dataset(
    parent: str | os.PathLike | RolloutDataset,
    out: str | os.PathLike,
    row_filter: RowFilter,
    *,
    command: str | None = None,
    writer_id: str = OPERATION,
    progress: bool = True,
) -> DeriveResult:
    """Write the rows of ``parent`` that pass ``row_filter`` into the new dataset ``out``; resumable."""
    return derive_dataset(
        parent, out, row_filter, operation=OPERATION, details=row_filter.details(), command=command,
        writer_id=writer_id, progress=progress,
    )


def parse_list(text: str, what: str) -> tuple[str, ...]:
    """``"a,b"`` -> ``("a", "b")``; empty items are an error."""
    items = tuple(s.strip() for s in text.split(","))
    if not items or any(not s for s in items):
        raise ValueError(f"{what} {text!r}: give one or more comma-separated values, none empty")
    return items


def parse_weight_versions(text: str) -> tuple[tuple[str, ...] | None, tuple[int | None, int | None] | None]:
    """``"3,4"`` -> a list of versions; ``"3..5"``, ``"3.."``, ``"..5"`` -> an inclusive integer range."""
    if ".." not in text:
        return parse_list(text, "--weight-version"), None
    lo, _, hi = text.partition("..")
    try:
        bounds = tuple(int(b) if b.strip() else None for b in (lo, hi))
    except ValueError:
        raise ValueError(f"--weight-version {text!r}: a range is LO..HI of integers (either may be left out)") from None
    return None, bounds  # type: ignore[return-value]


def read_sample_ids(path: str | os.PathLike) -> frozenset[str]:
    """The ids in a file, one per line (blank lines and surrounding whitespace ignored)."""
    try:
        with open(path, encoding="utf-8") as f:
            ids = frozenset(line.strip() for line in f if line.strip())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--sample-ids {path}: cannot read it ({e.__class__.__name__}: {e})") from e
    if not ids:
        raise ValueError(f"--sample-ids {path}: no ids in the file (one sample_id per line)")
    return ids


def _in_range(versions: pa.ChunkedArray, lo: int | None, hi: int | None) -> pa.ChunkedArray:
    is_int = pc.fill_null(pc.match_substring_regex(versions, INT_VERSION), False)
    value = pc.cast(pc.if_else(is_int, versions, "0"), pa.int64())
    ok = is_int
    if lo is not None:
        ok = pc.and_(ok, pc.greater_equal(value, lo))
    if hi is not None:
        ok = pc.and_(ok, pc.less_equal(value, hi))
    return ok


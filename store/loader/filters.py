"""The filters: which rows and groups of a block reach a step, counted by reason.

In this order, each counted by reason in ``Step.metrics``: row status (``statuses``), agent
(``agents``), a missing reward (a failed row may have none; one NaN would turn its whole group's
advantages to NaN), staleness (rows whose oldest token's integer policy version, from the
``weight_versions`` spans, else the row's ``weight_version``, is more than ``max_staleness`` behind the
current policy version are skipped; rows without a version too, counted apart), then
groups left empty, then (optionally) groups whose remaining rewards are all equal (zero variance:
no GRPO signal; a group of one row is one). The counts are of the groups this rank examined.

The policy version may change between steps (:meth:`RolloutLoader.set_current_version`); a step is
always planned with the version in effect when the trainer asks for it: a :class:`Segment` records
the range of versions its staleness decisions hold for, and a prefetched step is re-planned when a
version change falls outside it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollshard.store.format.groups import is_zero_variance
from rollshard.store.loader.config import FILTER_KEYS, NO_VERSION, LoaderConfig

if TYPE_CHECKING:
    from rollshard.store.loader.read import BlockData


@dataclasses.dataclass(frozen=True)
class Filters:
    statuses: pa.Array
    agents: pa.Array | None
    staleness: bool
    drop_zero_variance: bool
    routing: bool = False  # read the schema 1.2 routed_experts column where a shard has it

    @classmethod
    def of(cls, cfg: LoaderConfig) -> "Filters":
        return cls(
            statuses=pa.array(list(cfg.statuses), pa.string()),
            agents=None if cfg.agents is None else pa.array(list(cfg.agents), pa.string()),
            staleness=cfg.max_staleness is not None,
            drop_zero_variance=cfg.drop_zero_variance,
            routing=cfg.routed_experts,
        )



def _versions(col: pa.ChunkedArray | pa.Array, strict: bool = True) -> np.ndarray:
    """[rows] int64 versions; NO_VERSION for a null, and (not ``strict``) for a version that is no integer."""
    enc = pc.dictionary_encode(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
    idx = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False)
    parsed = [parse_version(v, "weight_version") if strict else int_version(v) for v in enc.dictionary.to_pylist()]
    values = np.array(parsed + [NO_VERSION], np.int64)
    return values[idx]  # index -1 (null) picks NO_VERSION


def oldest_versions(small: pa.Table, strict: bool = True) -> np.ndarray:
    """[rows] each row's oldest policy version: its ``weight_version``, or the least of its tokens' spans
    (``weight_versions``: a request continued across a weight update has several) when older; NO_VERSION when
    the row has no version. ``strict``: a version that is no integer raises (the staleness filter compares
    them), else it counts as no version (its row's staleness is unknown)."""
    versions = _versions(small.column("weight_version"), strict)
    if "weight_versions" not in small.column_names:
        return versions
    spans = small.column("weight_versions").combine_chunks()
    lengths = spans.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
    if not lengths.any():
        return versions
    span_versions = _versions(pc.struct_field(pc.list_flatten(spans), "version"), strict)  # [spans]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    has = lengths > 0
    oldest = versions.copy()
    oldest[has] = np.minimum(versions[has], np.minimum.reduceat(span_versions, starts[has]))
    # NO_VERSION is the least int64: a row without a weight_version, or with a span without one, stays unknown
    return oldest


def int_version(version: Any) -> int:
    """A policy version as an integer, NO_VERSION when it has none or it is no integer (its staleness is unknown)."""
    try:
        return parse_version(version, "weight_version")
    except ValueError:
        return NO_VERSION


def parse_version(version: Any, what: str) -> int:
    try:
        return int(version)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{what} {version!r} is not an integer; the staleness filter (max_staleness) compares integer policy "
            "versions: record the training step as the engine's weight_version, or turn max_staleness off"
        ) from e



class Segment:
    """The rows examined while planning one step: counts by reason, and the versions the plan holds for.

    A plan made with staleness threshold ``t`` (keep rows with version >= t) is the same plan for any
    threshold in ``(lo, hi]``: ``lo`` is the newest version dropped as stale, ``hi`` the oldest kept.
    """

    def __init__(self, threshold: int | None, filters: Filters):
        self.threshold, self.filters = threshold, filters
        self.lo, self.hi = -math.inf, math.inf
        self.counts = dict.fromkeys(FILTER_KEYS, 0)

    def holds_for(self, threshold: int | None) -> bool:
        return threshold is None or self.lo < threshold <= self.hi

    def examine(self, bd: BlockData, j: int) -> np.ndarray | None:
        """Rows of group ``j`` of ``bd`` that pass every filter, or None when the group is dropped."""
        c, rows = self.counts, bd.group_rows[j]
        c["groups_examined"] += 1
        c["rows_examined"] += len(rows)
        ok = bd.pass_status[rows]
        c["filtered_rows/status"] += len(rows) - int(ok.sum())
        if bd.pass_agent is not None:
            agent_ok = bd.pass_agent[rows]
            c["filtered_rows/agent"] += int((ok & ~agent_ok).sum())
            ok &= agent_ok
        # A failed row may have no reward; one NaN would make its whole group's advantages NaN.
        has_reward = np.isfinite(bd.reward[rows])
        c["filtered_rows/no_reward"] += int((ok & ~has_reward).sum())
        ok &= has_reward
        if self.threshold is not None:
            v = bd.version[rows]
            known = v != NO_VERSION
            fresh = known & (v >= self.threshold)
            stale = ok & known & ~fresh
            c["filtered_rows/no_version"] += int((ok & ~known).sum())
            c["filtered_rows/stale"] += int(stale.sum())
            if stale.any():
                self.lo = max(self.lo, int(v[stale].max()))
            ok &= fresh
            if ok.any():
                self.hi = min(self.hi, int(v[ok].min()))
        kept = rows[ok]
        if not len(kept):
            c["filtered_groups/empty"] += 1
            return None
        if self.filters.drop_zero_variance and is_zero_variance(bd.reward[kept]):
            c["filtered_groups/zero_variance"] += 1
            c["filtered_rows/zero_variance"] += len(kept)
            return None
        return kept




@dataclasses.dataclass(frozen=True)
class PolicyVersion:
    text: str | None = None
    threshold: int | None = None  # keep rows with weight_version >= threshold (None: no staleness filter)


class VersionBox:
    """The trainer's current policy version, shared with the producer thread."""

    def __init__(self) -> None:
        self.current = PolicyVersion()

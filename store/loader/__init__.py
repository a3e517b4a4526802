"""The streaming loader: committed shards in, optimizer steps of whole GRPO groups out.

The trainer never holds the dataset. :class:`RolloutLoader` reads one block (a Parquet
row group; several when a group spans row groups of one shard) at a time on a
background thread, keeps at most one shuffle window of groups, and packs each step's
sequences into flat micro-batches (store/packing.py) on a second background thread.

**One global stream, read by every rank.** Every rank computes the same stream of
groups: blocks in an order drawn from ``(seed, epoch)``, their groups cut into
consecutive windows of ``shuffle_window`` groups, each window permuted by
``(seed, epoch, window)``. The stream is cut into global steps of
``groups_per_step * world_size`` groups that pass the filters, and rank ``r`` takes
the ``r``-th slice of ``groups_per_step``. So the ranks' groups are disjoint, their
union over an epoch is the filtered dataset with each group once, and every rank has
the same number of steps. The price is that every rank reads every block (it must
see the whole stream to know its share); reading runs far ahead of training (see
the README's Performance figures). Groups never span steps, ranks or epochs: a group
is the unit of everything here, and the writer's contract (a group never spans
shards) is checked when the loader opens the dataset.

**Tail.** An epoch rarely holds a whole number of global steps. ``tail="drop"`` (the
default) drops the last incomplete global step (counted as ``tail_dropped_groups`` in
:attr:`RolloutLoader.epoch_stats`); ``tail="partial"`` yields it as a smaller last step,
split as evenly as possible, so a rank may get fewer groups, or none (a step with no
micro-batches; the trainer still takes part in the step). Nothing is ever duplicated.

**Filters**, in this order, each counted by reason in ``Step.metrics``: row status
(``statuses``), agent (``agents``), a missing reward (a failed row may have none; one
NaN would turn its whole group's advantages to NaN), staleness (rows whose integer ``weight_version``
is more than ``max_staleness`` behind the current policy version are skipped; rows
without a version too, counted apart), then groups left empty, then (optionally)
groups whose remaining rewards are all equal (zero variance: no GRPO signal; a group
of one row is one). Filter counts are of the global stream, the same on every rank;
packing figures (``groups``, ``tokens``, ``packing_efficiency``, ...) are this rank's.

**Exact resume.** The cursor is ``(epoch, position in the epoch's stream, step index)``:
the position counts raw groups (before filtering), so a resume re-reads only the
current window's blocks. The policy version may change between steps
(:meth:`RolloutLoader.set_current_version`); a step is always planned with the
version in effect when the trainer asks for it. Prefetched steps record the range of
versions their staleness decisions hold for, and are re-planned when a version change
falls outside it.

**Damaged data never reaches a step.** A shard is checked against its manifest entry
and the schema before its rows are used, and a break raises
:class:`~rollshard.store.errors.DataError` (re-exported here) out of iteration, one line
naming the shard, the row (sample id) and the problem: when the loader opens the
dataset, every shard's footer, schema version, size, and the exact types of the columns
read (no cast: int64 ids or float64 logprobs are refused); at every open of a file, its
size; for every block read, the row invariants of schema.py on the columns read
(:func:`~rollshard.store.schema.check_projection`: logprobs finite and <= 0 under the
mask, lengths aligned, token ids non-negative, a known status, ...); and the file's
sha256, hashed on a third thread (store/integrity.py :class:`Checksums`), queued a few
blocks before the reader reaches the shard. A step is planned from blocks as they
arrive but handed on only once every shard it draws from is verified, so a shard whose
bytes changed can cost a planned step, never a delivered one. Each shard is hashed once
per loader (a later epoch does not hash again). ``LoaderConfig.verify_data=False`` turns
the checks off, for measuring what they cost only (tests/bench/bench_loader.py).

**Sampling supports** (schema 1.1): a shard that has the two sampling columns has them read
with the token columns (only for blocks with a row that passes the filters, and checked with
them); a 1.0 shard is read as before. :class:`PackedBatch` then carries ``sampling_logprobs``,
``has_support``, ``support_ids`` and ``support_offsets`` for each micro-batch with a supported
row (store/packing.py gives their exact meaning), None otherwise. A micro-batch holds at most
``micro_batch_support`` support ids besides at most ``micro_batch_tokens`` tokens (a sequence
over either gets one of its own). :func:`hf_groups` adds the two columns per row (None for a
row without a support).

**Memory**: one window of groups, ``prefetch`` blocks and ``prefetch`` packed steps,
independent of the dataset's size (plus one 8-byte hash per group while the dataset
is opened, to check that no group spans two shards).

**Several datasets** (``--data a:0.7,b:0.3``): store/mixture.py draws each dataset's group
stream (:meth:`_Stream.groups`, the stream above before it is cut into steps) and fills
each step's group slots from them by weight.

HF ``datasets`` users can get the same groups through :func:`hf_groups`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import queue
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from rollshard.store.groups import is_zero_variance
from rollshard.store.dataset import RolloutDataset
from rollshard.store.errors import DataError
from rollshard.store.integrity import (
    Checksums,
    check_column_types,
    check_rows,
    open_shard,
    sampling_columns,
    verify_sha256,
)
from rollshard.store.manifest import ShardInfo
from rollshard.store.packing import PackedBatch, Sequences, pack
from rollshard.store.schema import OPTIONAL_COLUMNS, STATUS_VALUES
from rollshard.store.storage import Storage

__all__ = ["DataError", "LoaderConfig", "LoaderStateError", "PackedBatch", "RolloutLoader", "Step", "hf_groups"]

STATE_FORMAT = "rollshard-loader"
MIXTURE_STATE_FORMAT = "rollshard-loader-mixture"  # store/mixture.py
STATE_VERSION = 1
SMALL_COLUMNS = ["sample_id", "group_id", "agent", "status", "reward", "weight_version", "temperature"]
TOKEN_COLUMNS = ["prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask"]
SAMPLING_COLUMNS = list(OPTIONAL_COLUMNS)  # schema 1.1, read with the token columns when a shard has them
NO_VERSION = np.iinfo(np.int64).min  # a row without weight_version: its staleness is unknown
POLL_S = 0.1  # how often a blocked background thread checks whether it was told to stop
JOIN_S = 10.0  # how long close() waits for a thread to finish the read it is in
OPEN_FILES = 16  # Parquet files a reader keeps open (shards are read block by block, in shuffled order)
SCAN_THREADS = 8  # shards scanned at once when the loader opens a dataset (I/O bound)
HASH_AHEAD_BLOCKS = 8  # shards of the next blocks queued for their checksum before the reader gets there
_TAG_BLOCKS, _TAG_WINDOW = 1, 2  # random streams: block order, window permutation

FILTER_KEYS = (
    "groups_examined",
    "rows_examined",
    "filtered_rows/status",
    "filtered_rows/agent",
    "filtered_rows/no_reward",
    "filtered_rows/stale",
    "filtered_rows/no_version",
    "filtered_groups/empty",
    "filtered_groups/zero_variance",
    "filtered_rows/zero_variance",
)
SOURCE_KEYS = ("groups", "sequences", "tokens", "loss_tokens")  # a mixture's per-source figures of a step (this rank)


class LoaderStateError(ValueError):
    """A loader state does not fit this loader (world size, seed, dataset, order settings)."""


@dataclasses.dataclass(kw_only=True)
class LoaderConfig:
    """Settings of a :class:`RolloutLoader`; see the module docstring for what each one means."""

    groups_per_step: int = 8  # whole GRPO groups per optimizer step (per rank)
    micro_batch_tokens: int = 8192  # token budget of one packed micro-batch (prompt + response tokens)
    # Support-id budget of one micro-batch (schema 1.1 supports, PackedBatch.support_ids); None:
    # packing.SUPPORT_PER_TOKEN (64) x micro_batch_tokens, which never binds for top-k <= 64, so ordinary
    # top-k 20-50 data packs exactly as by tokens, and bounds a top-k 4096 micro-batch's ids at 1/64.
    micro_batch_support: int | None = None
    seed: int = 0
    shuffle: bool = True
    shuffle_window: int = 1024  # groups in the bounded shuffle window
    statuses: tuple[str, ...] = ("completed", "truncated")
    agents: tuple[str, ...] | None = None  # None: every agent
    max_staleness: int | None = None  # needs current_version
    current_version: str | None = None
    drop_zero_variance: bool = False
    num_epochs: int | None = 1  # None: loop forever
    prefetch: int = 4  # blocks read ahead, and packed steps ready ahead
    tail: Literal["drop", "partial"] = "drop"  # the last incomplete global step of an epoch
    pin_memory: bool = False  # page-lock the packed tensors (when CUDA is available)
    # Checksums, exact column types and row invariants (module docstring). Off only to measure what they
    # cost: a damaged shard then reaches the trainer.
    verify_data: bool = True

    def check(self) -> None:
        for name in ("groups_per_step", "micro_batch_tokens", "shuffle_window", "prefetch"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoaderConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.micro_batch_support is not None and self.micro_batch_support < 1:
            raise ValueError(
                f"LoaderConfig.micro_batch_support must be at least 1 or None (64 x micro_batch_tokens), "
                f"got {self.micro_batch_support}"
            )
        if self.seed < 0:
            raise ValueError(f"LoaderConfig.seed must be non-negative, got {self.seed}")
        bad = [s for s in self.statuses if s not in STATUS_VALUES]
        if bad or not self.statuses:
            raise ValueError(
                f"LoaderConfig.statuses {self.statuses!r}: choose one or more of {', '.join(STATUS_VALUES)}"
            )
        if self.agents is not None and not self.agents:
            raise ValueError("LoaderConfig.agents is empty; use None for every agent")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"LoaderConfig.max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"LoaderConfig.num_epochs must be >= 1 or None (forever), got {self.num_epochs}")
        if self.tail not in ("drop", "partial"):
            raise ValueError(f"LoaderConfig.tail must be 'drop' or 'partial', got {self.tail!r}")


@dataclasses.dataclass(kw_only=True)
class Step:
    """One optimizer step on one rank: whole groups, packed into micro-batches."""

    micro_batches: list[PackedBatch]
    group_ids: list[str]  # [G]; PackedBatch.seq_group indexes this
    epoch: int
    index: int  # step index, counted across epochs
    metrics: dict[str, float]  # module docstring: filter counts (global) and packing figures (this rank)
    group_sources: list[str] | None = None  # [G] source name of each group (a mixture, store/mixture.py); else None

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.micro_batches)

    @property
    def num_sequences(self) -> int:
        return sum(b.num_sequences for b in self.micro_batches)


# -- the dataset's blocks ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Block:
    """Row groups of one shard that hold whole groups (one row group unless a group spans several)."""

    shard: int
    row_groups: tuple[int, ...]
    num_groups: int


def _open(dataset: RolloutDataset, shard: int) -> tuple[Any, pq.ParquetFile]:
    return open_shard(dataset.storage, dataset.shards[shard])  # size and schema version at every open


def _shard_blocks(pf: pq.ParquetFile) -> tuple[list[tuple[tuple[int, ...], int]], list[str]]:
    """Blocks of one shard as (row groups, group count), and its group ids; reads only group_id."""
    n = pf.metadata.num_row_groups
    first: dict[str, int] = {}
    reach = list(range(n))  # reach[i]: last row group holding a group that starts in row group i
    for rg in range(n):
        for g in pc.unique(pf.read_row_group(rg, columns=["group_id"]).column(0)).to_pylist():
            start = first.setdefault(g, rg)
            reach[start] = max(reach[start], rg)
    starts = np.bincount(np.fromiter(first.values(), np.int64, len(first)), minlength=n)
    blocks, s = [], 0
    while s < n:
        end, i = reach[s], s
        while i <= end:
            end, i = max(end, reach[i]), i + 1
        blocks.append((tuple(range(s, end + 1)), int(starts[s : end + 1].sum())))
        s = end + 1
    return blocks, list(first)


def _scan_blocks(dataset: RolloutDataset, check_types: bool = True) -> list[_Block]:
    """Every block of the dataset; raises when a group has rows in two shards."""

    def scan(i: int):
        where = dataset.shards[i].path
        f, pf = _open(dataset, i)
        with f:
            if check_types:
                check_column_types(pf.schema_arrow, SMALL_COLUMNS + TOKEN_COLUMNS + SAMPLING_COLUMNS, where)
            try:
                blocks, ids = _shard_blocks(pf)
            except (OSError, pa.ArrowException) as e:
                raise DataError(f"{where}: cannot read its group ids: {_one_line(e)}") from e
        return blocks, np.fromiter((hash(g) for g in ids), np.int64, len(ids))

    with ThreadPoolExecutor(max_workers=min(SCAN_THREADS, max(1, len(dataset.shards)))) as pool:
        scanned = list(pool.map(scan, range(len(dataset.shards))))
    hashes = np.concatenate([h for _, h in scanned]) if scanned else np.zeros(0, np.int64)
    uniq, counts = np.unique(hashes, return_counts=True)
    if (counts > 1).any():
        _raise_split_groups(dataset, set(uniq[counts > 1].tolist()))
    return [_Block(shard=i, row_groups=rgs, num_groups=ng) for i, (bl, _) in enumerate(scanned) for rgs, ng in bl]


def _raise_split_groups(dataset: RolloutDataset, suspects: set[int]) -> None:
    where: dict[str, list[str]] = collections.defaultdict(list)
    for i, shard in enumerate(dataset.shards):
        f, pf = _open(dataset, i)
        with f:
            for g in _shard_blocks(pf)[1]:
                if hash(g) in suspects:
                    where[g].append(shard.path)
    split = {g: paths for g, paths in where.items() if len(paths) > 1}
    if split:  # otherwise two ids only shared a 64-bit hash
        g, paths = next(iter(split.items()))
        raise ValueError(
            f"group {g!r} has rows in shards {', '.join(paths)} ({len(split)} groups span shards); a GRPO group must "
            "lie in one shard: write every group with one ShardWriter.write_group call"
        )


@dataclasses.dataclass(frozen=True)
class _Filters:
    statuses: pa.Array
    agents: pa.Array | None
    staleness: bool
    drop_zero_variance: bool

    @classmethod
    def of(cls, cfg: LoaderConfig) -> "_Filters":
        return cls(
            statuses=pa.array(list(cfg.statuses), pa.string()),
            agents=None if cfg.agents is None else pa.array(list(cfg.agents), pa.string()),
            staleness=cfg.max_staleness is not None,
            drop_zero_variance=cfg.drop_zero_variance,
        )


def _single(col: pa.ChunkedArray) -> pa.Array:
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _bool(arr: pa.Array) -> np.ndarray:
    return arr.fill_null(False).to_numpy(zero_copy_only=False)


class _BlockData:
    """One block in memory: the filter columns as numpy, token columns as flat values + offsets."""

    shard: int = -1  # index in dataset.shards (-1: read outside a loader)

    def __init__(self, small: pa.Table, filters: _Filters):
        enc = pc.dictionary_encode(_single(small.column("group_id")))  # codes in order of first appearance
        codes = enc.indices.to_numpy()
        self.group_ids: list[str] = enc.dictionary.to_pylist()
        order = np.argsort(codes, kind="stable")
        self.group_rows = np.split(order, np.cumsum(np.bincount(codes, minlength=len(self.group_ids)))[:-1])
        self.pass_status = _bool(pc.is_in(_single(small.column("status")), value_set=filters.statuses))
        self.pass_agent = None
        if filters.agents is not None:
            self.pass_agent = _bool(pc.is_in(_single(small.column("agent")), value_set=filters.agents))
        self.version = _versions(small.column("weight_version")) if filters.staleness else None
        self.reward = small.column("reward").to_numpy().astype(np.float32)  # null (failed rows) -> NaN
        self.temperature = small.column("temperature").to_numpy().astype(np.float32)  # null -> NaN
        self.sample_id: list[str] = small.column("sample_id").to_pylist()
        self.agent: list[str] = small.column("agent").to_pylist()
        self.weight_version: list[str | None] = small.column("weight_version").to_pylist()
        passing = self.pass_status if self.pass_agent is None else self.pass_status & self.pass_agent
        self.needs_tokens = bool(passing.any())
        self.tokens: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
        self.support: tuple[np.ndarray, ...] | None = None

    def set_tokens(self, table: pa.Table) -> None:
        self.tokens = {}
        for name in TOKEN_COLUMNS:
            arr = _single(table.column(name))
            self.tokens[name] = (arr.values.to_numpy(), arr.offsets.to_numpy())
        self.support = None  # (has [rows], ids [n], id offsets [tokens + 1], token offsets [rows + 1]) of 1.1 shards
        if "sampling_support" in table.column_names and table.column("sampling_support").null_count < table.num_rows:
            sup, lp = _single(table.column("sampling_support")), _single(table.column("sampling_logprobs"))
            self.tokens["sampling_logprobs"] = (lp.values.to_numpy(zero_copy_only=False), lp.offsets.to_numpy())
            inner = sup.values  # [tokens] one support per token (the offsets below index it as they are)
            self.support = (sup.is_valid().to_numpy(zero_copy_only=False), inner.values.to_numpy(),
                            inner.offsets.to_numpy(), sup.offsets.to_numpy())

    def row_tokens(self, name: str, row: int) -> np.ndarray:
        values, offsets = self.tokens[name]
        return values[offsets[row] : offsets[row + 1]]

    def row_support(self, row: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The row's support as (ids [n] int32, size of each token's support [R] int64), or None without one."""
        if self.support is None or not self.support[0][row]:
            return None
        _, ids, id_off, tok_off = self.support
        bounds = id_off[tok_off[row] : tok_off[row + 1] + 1]  # [R + 1]
        return ids[bounds[0] : bounds[-1]], np.diff(bounds).astype(np.int64)

    def row_support_lists(self, row: int) -> list[list[int]] | None:
        """The row's support as one list of ids per token (HF examples), or None."""
        sup = self.row_support(row)
        if sup is None:
            return None
        ids, sizes = sup
        return [a.tolist() for a in np.split(ids, np.cumsum(sizes)[:-1])] if len(sizes) else []


def _versions(col: pa.ChunkedArray) -> np.ndarray:
    enc = pc.dictionary_encode(_single(col))
    idx = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False)
    parsed = [_parse_version(v, "weight_version") for v in enc.dictionary.to_pylist()]
    values = np.array(parsed + [NO_VERSION], np.int64)
    return values[idx]  # index -1 (null) picks NO_VERSION


def _parse_version(version: Any, what: str) -> int:
    try:
        return int(version)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{what} {version!r} is not an integer; the staleness filter (max_staleness) compares integer policy "
            "versions: record the training step as the engine's weight_version, or turn max_staleness off"
        ) from e


def _read_block(pf: pq.ParquetFile, block: _Block, filters: _Filters, shard: str, check: bool = True) -> _BlockData:
    """Column projection: the filter columns first, the token columns only when some row passes.

    With ``check``, the rows read are checked (:func:`rollshard.store.integrity.check_rows`) before
    anything is built from them; ``shard`` (dataset-relative path) names the block in errors.
    """
    rgs = list(block.row_groups)
    where = f"{shard} (row group{'s' * (len(rgs) > 1)} {', '.join(map(str, rgs))})"
    try:
        small = _one_chunk(pf.read_row_groups(rgs, columns=SMALL_COLUMNS))
        tokens = None
        if _passes(small, filters).any():  # the sampling columns only from a shard that has them (not a 1.0 one)
            token_columns = TOKEN_COLUMNS + sampling_columns(pf.schema_arrow, shard)
            tokens = _one_chunk(pf.read_row_groups(rgs, columns=token_columns))
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{where}: not readable: {_one_line(e)}") from e
    if check:  # one check of the columns read (a block none of whose rows passes reaches no step)
        columns = {**{n: small.column(n) for n in SMALL_COLUMNS}, **({} if tokens is None else
                   {n: tokens.column(n) for n in tokens.column_names})}
        check_rows(pa.table(columns), where)
    try:
        data = _BlockData(small, filters)
    except DataError:
        raise
    except ValueError as e:  # a weight_version the staleness filter cannot read: name the block
        raise DataError(f"{where}: {e}") from e
    assert data.needs_tokens == (tokens is not None)
    if tokens is not None:
        data.set_tokens(tokens)
    return data


def _one_chunk(table: pa.Table) -> pa.Table:
    """Each column in one chunk (a block of several row groups reads as several), so that the checks and
    the token arrays below see flat buffers without copying twice."""
    return pa.table({n: _single(table.column(n)) for n in table.column_names})


def _passes(small: pa.Table, filters: _Filters) -> np.ndarray:
    """[rows] whether a row passes the status and agent filters (those that decide whether tokens are read)."""
    ok = _bool(pc.is_in(_single(small.column("status")), value_set=filters.statuses))
    if filters.agents is not None:
        ok &= _bool(pc.is_in(_single(small.column("agent")), value_set=filters.agents))
    return ok


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


# -- order ---------------------------------------------------------------------------------


def _random_keys(n: int, *words: int) -> np.ndarray:
    """``n`` random 64-bit keys from a bit generator whose stream numpy keeps stable across versions."""
    return np.random.PCG64(np.random.SeedSequence(list(words))).random_raw(n)


class _EpochPlan:
    """Block order and window permutations of one epoch (the same on every rank)."""

    def __init__(self, blocks: list[_Block], cfg: LoaderConfig, epoch: int):
        self.cfg, self.epoch = cfg, epoch
        n = len(blocks)
        keys = _random_keys(n, cfg.seed, epoch, _TAG_BLOCKS)
        self.order = np.argsort(keys, kind="stable") if cfg.shuffle else np.arange(n)
        self.cum = np.zeros(n + 1, np.int64)  # cum[i]: groups in the blocks before position i
        np.cumsum([blocks[b].num_groups for b in self.order], out=self.cum[1:])
        self.num_groups = int(self.cum[-1])
        self.window = cfg.shuffle_window
        self.num_windows = -(-self.num_groups // self.window)

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.window, min((k + 1) * self.window, self.num_groups)

    def first_block(self, position: int) -> int:
        """Position in ``order`` of the block holding stream position ``position``'s window start."""
        start = (position // self.window) * self.window
        if start >= self.num_groups:
            return len(self.order)
        return int(np.searchsorted(self.cum, start, side="right") - 1)

    def permutation(self, k: int) -> np.ndarray:
        lo, hi = self.bounds(k)
        if not self.cfg.shuffle:
            return np.arange(hi - lo)
        return np.argsort(_random_keys(hi - lo, self.cfg.seed, self.epoch, _TAG_WINDOW, k), kind="stable")


# -- filtering and step planning -----------------------------------------------------------


class _Segment:
    """The rows examined while planning one step: counts by reason, and the versions the plan holds for.

    A plan made with staleness threshold ``t`` (keep rows with version >= t) is the same plan for any
    threshold in ``(lo, hi]``: ``lo`` is the newest version dropped as stale, ``hi`` the oldest kept.
    """

    def __init__(self, threshold: int | None, filters: _Filters):
        self.threshold, self.filters = threshold, filters
        self.lo, self.hi = -math.inf, math.inf
        self.counts = dict.fromkeys(FILTER_KEYS, 0)

    def holds_for(self, threshold: int | None) -> bool:
        return threshold is None or self.lo < threshold <= self.hi

    def examine(self, bd: _BlockData, j: int) -> np.ndarray | None:
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
class _Cursor:
    epoch: int = 0
    position: int = 0  # raw groups of the epoch's stream already examined
    step: int = 0  # index of the next step


@dataclasses.dataclass(frozen=True)
class _Version:
    text: str | None = None
    threshold: int | None = None  # keep rows with weight_version >= threshold (None: no staleness filter)


class _VersionBox:
    """The trainer's current policy version, shared with the producer thread."""

    def __init__(self) -> None:
        self.current = _Version()


@dataclasses.dataclass(frozen=True)
class _EpochEnd:
    """Marks the end of an epoch in :meth:`_Stream.groups`."""

    epoch: int
    num_groups: int  # raw groups of the epoch's stream


@dataclasses.dataclass
class _Item:
    """What the producer hands over: a step (or an epoch end), the cursor after it, and its validity."""

    step: Step | None
    cursor: _Cursor
    epoch_counts: dict[str, int]
    segment: _Segment


# -- background threads --------------------------------------------------------------------


class _Stopped(Exception):
    """Raised inside a background thread told to stop while it waits."""


_END = object()


class _Background:
    """Runs the generator ``produce(stop_event)`` on a daemon thread; items come through a bounded queue."""

    def __init__(self, produce: Callable[[threading.Event], Iterator[Any]], maxsize: int, name: str):
        self._queue: queue.Queue = queue.Queue(maxsize)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(produce,), name=name, daemon=True)
        self._thread.start()

    def _run(self, produce) -> None:
        gen = produce(self._stop)
        try:
            for item in gen:
                if not self._put(item):
                    return
            self._put(_END)
        except _Stopped:
            pass
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(_Failure(e))
        finally:
            gen.close()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self, stop: threading.Event | None = None):
        """The next item, or ``_END``; raises what the thread raised, or ``_Stopped`` once ``stop`` is set."""
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    raise _Stopped from None
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the loader's background thread ended without a result")
                continue
            if isinstance(item, _Failure):
                raise item.error
            return item

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a put
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_S)


@dataclasses.dataclass
class _Failure:
    error: BaseException


# -- the stream ----------------------------------------------------------------------------


class _Stream:
    """The global group stream and this rank's steps, as a deterministic function of the cursor."""

    def __init__(self, dataset: RolloutDataset, blocks: list[_Block], cfg: LoaderConfig, rank: int, world_size: int):
        self.dataset, self.blocks, self.cfg = dataset, blocks, cfg
        self.rank, self.world_size = rank, world_size
        self.filters = _Filters.of(cfg)
        self._plans: dict[int, _EpochPlan] = {}
        self.checksums = Checksums(dataset.storage, dataset.shards, f"rollshard-checksum-{rank}")
        self.num_groups = sum(b.num_groups for b in blocks)

    def plan(self, epoch: int) -> _EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:  # two threads may both build it; plans are pure, so either copy is right
            plan = self._plans[epoch] = _EpochPlan(self.blocks, self.cfg, epoch)
            for old in [e for e in self._plans if e < epoch - 1]:
                self._plans.pop(old, None)
        return plan

    def read_blocks(
        self, start: _Cursor, preloaded: dict, stop: threading.Event
    ) -> Iterator[tuple[tuple[int, int], _BlockData]]:
        """Blocks from the start of ``start``'s window on, epoch after epoch, keyed (epoch, position)."""
        files: collections.OrderedDict[int, tuple[Any, pq.ParquetFile]] = collections.OrderedDict()
        epoch, pos = start.epoch, self.plan(start.epoch).first_block(start.position)
        try:
            while (self.cfg.num_epochs is None or epoch < self.cfg.num_epochs) and not stop.is_set():
                order = self.plan(epoch).order
                for i in range(pos, len(order)):
                    if stop.is_set():
                        return
                    if self.cfg.verify_data:  # hashing runs ahead of the reading, so that a step rarely waits
                        for b in order[i : i + HASH_AHEAD_BLOCKS]:
                            self.checksums.touch(self.blocks[b].shard)
                    data = preloaded.pop((epoch, i), None)
                    if data is None:
                        data = self._read(files, self.blocks[order[i]], stop)
                        if data is None:
                            return
                    yield (epoch, i), data
                epoch, pos = epoch + 1, 0
        finally:
            for f, _ in files.values():
                f.close()

    def _read(self, files: collections.OrderedDict, block: _Block, stop: threading.Event) -> _BlockData | None:
        """One block, checked; None when told to stop while waiting for a checksum."""
        shard = self.dataset.shards[block.shard].path
        verify = self.cfg.verify_data  # read_blocks queued this shard's checksum already
        try:
            data = _read_block(self._file(files, block.shard), block, self.filters, shard, check=verify)
            if len(data.group_ids) != block.num_groups:
                raise DataError(
                    f"{shard}: row groups {list(block.row_groups)} hold {len(data.group_ids)} groups, "
                    f"{block.num_groups} when the loader opened the dataset; a committed shard must not change "
                    "(open a new loader)"
                )
        except DataError:
            # Damaged bytes show up as unreadable pages or absurd values; the checksum names the cause.
            if verify and not self.checksums.wait(block.shard, stop):
                return None
            raise
        data.shard = block.shard
        return data

    def _verified(self, pending: list[tuple[_BlockData, int, np.ndarray]], stop: threading.Event) -> None:
        """Wait until every shard ``pending`` draws from is verified (raises the DataError of one that is not)."""
        if not self.cfg.verify_data:
            return
        for shard in sorted({bd.shard for bd, _, _ in pending}):
            if not self.checksums.wait(shard, stop):
                raise _Stopped

    def _file(self, files: collections.OrderedDict, shard: int) -> pq.ParquetFile:
        if shard in files:
            files.move_to_end(shard)
        else:
            files[shard] = _open(self.dataset, shard)
            if len(files) > OPEN_FILES:
                files.popitem(last=False)[1][0].close()
        return files[shard][1]

    def reader(self, start: _Cursor, preloaded: dict) -> _Background:
        """The block reader thread from the start of ``start``'s window on (``preloaded``: blocks in memory)."""
        return _Background(
            lambda s: self.read_blocks(start, preloaded, s), self.cfg.prefetch, f"rollshard-loader-read-{self.rank}"
        )

    def groups(
        self, start: _Cursor, reader: _Background, held: dict, stop: threading.Event
    ) -> Iterator[tuple[int, int, _BlockData, int] | _EpochEnd]:
        """The raw group stream from ``start`` on (before any filter), epoch after epoch.

        Yields ``(epoch, position after the group, block, index of the group in the block)`` for each group,
        and an :class:`_EpochEnd` after each epoch's last. ``held`` holds the current window's blocks (read
        through ``reader``); it is emptied when the epoch after an _EpochEnd is asked for.
        """
        epoch, position = start.epoch, start.position
        while self.cfg.num_epochs is None or epoch < self.cfg.num_epochs:
            plan = self.plan(epoch)
            for k in range(position // plan.window, plan.num_windows):
                lo, hi = plan.bounds(k)
                where = np.searchsorted(plan.cum, np.arange(lo, hi), side="right") - 1  # block of each group
                self._pull(reader, held, epoch, int(where[0]), int(where[-1]), stop)
                perm = plan.permutation(k)
                for p in range(max(position, lo) - lo, hi - lo):
                    i = int(where[perm[p]])
                    yield epoch, lo + p + 1, held[(epoch, i)], lo + int(perm[p]) - int(plan.cum[i])
            yield _EpochEnd(epoch=epoch, num_groups=plan.num_groups)
            epoch, position = epoch + 1, 0
            held.clear()

    def items(
        self,
        start: _Cursor,
        counts: dict[str, int],
        preloaded: dict,
        held: dict,
        version: "_VersionBox",
        stop: threading.Event,
    ) -> Iterator[_Item]:
        """Steps and epoch ends from ``start`` on: :meth:`groups` filtered and cut into global steps.

        ``preloaded``: blocks already in memory, by (epoch, position); ``held`` receives the blocks of the
        current window, so that a restart (a version change) need not read them again.
        """
        cfg = self.cfg
        full = cfg.groups_per_step * self.world_size
        reader = self.reader(start, preloaded)
        try:
            step = start.step
            epoch_counts = collections.Counter(counts)
            pending: list[tuple[_BlockData, int, np.ndarray]] = []
            seg = _Segment(version.current.threshold, self.filters)
            for g in self.groups(start, reader, held, stop):
                if isinstance(g, _EpochEnd):
                    if pending and cfg.tail == "partial":
                        self._verified(pending, stop)
                        epoch_counts.update(seg.counts)
                        epoch_counts["steps"] += 1
                        after = _Cursor(g.epoch, g.num_groups, step + 1)
                        yield self._item(pending, seg, after, g.epoch, step, epoch_counts)
                        step += 1
                        pending, seg = [], _Segment(seg.threshold, self.filters)
                    epoch_counts.update(seg.counts)
                    epoch_counts["tail_dropped_groups"] += len(pending)
                    if epoch_counts["steps"] == 0:
                        self._no_step(g.epoch, epoch_counts)
                    after = _Cursor(g.epoch + 1, 0, step)
                    yield _Item(step=None, cursor=after, epoch_counts=dict(epoch_counts), segment=seg)
                    epoch_counts = collections.Counter()
                    pending, seg = [], _Segment(version.current.threshold, self.filters)
                    continue
                epoch, after_position, bd, j = g
                kept = seg.examine(bd, j)
                if kept is not None:
                    pending.append((bd, j, kept))
                if len(pending) == full:
                    self._verified(pending, stop)
                    epoch_counts.update(seg.counts)
                    epoch_counts["steps"] += 1
                    yield self._item(pending, seg, _Cursor(epoch, after_position, step + 1), epoch, step, epoch_counts)
                    step += 1
                    pending, seg = [], _Segment(version.current.threshold, self.filters)
        finally:
            reader.close()

    @staticmethod
    def _pull(reader: _Background, held: dict, epoch: int, first: int, last: int, stop: threading.Event) -> None:
        """Make ``held`` hold exactly the blocks ``first..last`` of ``epoch`` (reading them in order)."""
        for key in [key for key in held if key < (epoch, first)]:
            del held[key]
        while (epoch, last) not in held:
            item = reader.get(stop)
            if item is _END:
                raise RuntimeError(f"block reader ended before block {last} of epoch {epoch}")
            key, data = item
            if key >= (epoch, first):
                held[key] = data

    def _no_step(self, epoch: int, counts: collections.Counter) -> None:
        kept = counts["groups_examined"] - counts["filtered_groups/empty"] - counts["filtered_groups/zero_variance"]
        msg = (
            f"epoch {epoch} yields no step: {kept} of {counts['groups_examined']} groups pass the filters, a step "
            f"needs {self.cfg.groups_per_step * self.world_size} (groups_per_step x world size); loosen the filters, "
            "lower groups_per_step, or set tail='partial'"
        )
        if self.cfg.num_epochs is None:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=2)

    def _item(self, pending, seg: _Segment, cursor: _Cursor, epoch: int, index: int, epoch_counts) -> _Item:
        step = make_step(pending, seg.counts, epoch=epoch, index=index, rank=self.rank, world_size=self.world_size,
                         cfg=self.cfg)
        return _Item(step=step, cursor=cursor, epoch_counts=dict(epoch_counts), segment=seg)


def make_step(
    pending: list[tuple[_BlockData, int, np.ndarray]],
    counts: dict[str, int],
    *,
    epoch: int,
    index: int,
    rank: int,
    world_size: int,
    cfg: LoaderConfig,
    sources: tuple[str, ...] | None = None,
    owners: list[int] | None = None,
) -> Step:
    """This rank's share of one global step of ``pending`` groups ``(block, index in block, rows kept)``.

    Rank ``r`` of ``w`` takes ``pending[r * n // w : (r + 1) * n // w]``. ``counts``: the filter counts of
    the global step. A mixture (store/mixture.py) gives the source names and each pending group's source
    index (``owners``): the step then carries :attr:`Step.group_sources` and per-source figures.
    """
    n, r, w = len(pending), rank, world_size
    lo, hi = r * n // w, (r + 1) * n // w  # groups_per_step each in a full step; a tail as even as can be
    mine = pending[lo:hi]
    seqs, zero_var = _sequences(mine)
    batches, efficiency = pack(seqs, cfg.micro_batch_tokens, cfg.micro_batch_support)
    metrics = {k: float(v) for k, v in counts.items()}
    metrics.update(
        groups=float(len(mine)),
        sequences=float(len(seqs)),
        tokens=float(sum(b.num_tokens for b in batches)),
        loss_tokens=float(sum(b.num_loss_tokens for b in batches)),
        micro_batches=float(len(batches)),
        packing_efficiency=efficiency,
        zero_variance_groups=float(zero_var),
    )
    group_sources = None
    if sources is not None:
        group_sources = [sources[i] for i in owners[lo:hi]]  # [G]
        metrics.update(_source_metrics(batches, group_sources, sources))
    if cfg.pin_memory and torch.cuda.is_available():
        batches = [b.pin_memory() for b in batches]
    return Step(
        micro_batches=batches,
        group_ids=[bd.group_ids[j] for bd, j, _ in mine],
        epoch=epoch,
        index=index,
        metrics=metrics,
        group_sources=group_sources,
    )


def _source_metrics(batches: list[PackedBatch], group_sources: list[str], sources: tuple[str, ...]) -> dict[str, float]:
    """``source/<name>/{groups,sequences,tokens,loss_tokens}`` of this rank's step, 0 for a source without any."""
    out = {f"source/{name}/{k}": 0.0 for name in sources for k in SOURCE_KEYS}
    for name in group_sources:
        out[f"source/{name}/groups"] += 1
    for b in batches:
        cu = b.cu_seqlens.numpy().astype(np.int64)  # [S+1]
        mask = np.concatenate([[0.0], np.cumsum(b.loss_mask.numpy(), dtype=np.float64)])  # [T+1]
        loss = mask[cu[1:]] - mask[cu[:-1]]  # [S] loss tokens per sequence
        for g, n_tok, n_loss in zip(b.seq_group.tolist(), np.diff(cu).tolist(), loss.tolist()):
            name = group_sources[g]
            out[f"source/{name}/sequences"] += 1
            out[f"source/{name}/tokens"] += n_tok
            out[f"source/{name}/loss_tokens"] += n_loss
    return out


def _sequences(groups: list[tuple[_BlockData, int, np.ndarray]]) -> tuple[Sequences, int]:
    cols: dict[str, list] = collections.defaultdict(list)
    zero_var = 0
    for g, (bd, _, rows) in enumerate(groups):
        zero_var += is_zero_variance(bd.reward[rows])
        for row in rows.tolist():
            cols["prompt"].append(bd.row_tokens("prompt_tokens", row))
            cols["response"].append(bd.row_tokens("response_tokens", row))
            cols["logprobs"].append(bd.row_tokens("rollout_logprobs", row))
            cols["mask"].append(bd.row_tokens("loss_mask", row))
            cols["temperature"].append(bd.temperature[row])
            cols["reward"].append(bd.reward[row])
            cols["group"].append(g)
            cols["agent"].append(bd.agent[row])
            cols["sample_id"].append(bd.sample_id[row])
            cols["weight_version"].append(bd.weight_version[row])
            support = bd.row_support(row)
            cols["support"].append(support)
            cols["sampling_logprobs"].append(None if support is None else bd.row_tokens("sampling_logprobs", row))
    any_support = any(s is not None for s in cols["support"])
    seqs = Sequences(
        prompt=cols["prompt"],
        response=cols["response"],
        logprobs=cols["logprobs"],
        mask=cols["mask"],
        temperature=np.asarray(cols["temperature"], np.float32),
        reward=np.asarray(cols["reward"], np.float32),
        group=np.asarray(cols["group"], np.int64),
        agent=cols["agent"],
        sample_id=cols["sample_id"],
        weight_version=cols["weight_version"],
        sampling_logprobs=cols["sampling_logprobs"] if any_support else None,
        support=cols["support"] if any_support else None,
    )
    return seqs, zero_var


# -- the loader ----------------------------------------------------------------------------


class _StepLoader:
    """What every loader of steps shares: the producer thread, iteration from the cursor, the policy version.

    A subclass sets ``config``, ``rank``, ``world_size``, ``_cursor``, ``_epoch_counts`` and implements
    :meth:`_produce` (a function of the stop event that yields :class:`_Item`, holding no reference to the
    loader), :meth:`state_dict`, :meth:`load_state_dict` and :meth:`_close_streams`.
    """

    config: LoaderConfig
    rank: int
    world_size: int

    def _set_placement(self, config: LoaderConfig | None, rank: int, world_size: int) -> LoaderConfig:
        """Check and keep the config (default: :class:`LoaderConfig`), rank and world size; returns the config."""
        self.config = config = config or LoaderConfig()
        config.check()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        return config

    def _init_common(self) -> None:
        self._version = _VersionBox()
        if self.config.current_version is not None:
            self.set_current_version(self.config.current_version)
        self.epoch_stats: dict[str, float] = {}  # counts of the last finished epoch (incl. tail_dropped_groups)
        self._producer: _Background | None = None
        self._held: dict = {}  # the producer's current window of blocks (reused by a restart)

    # -- public API ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Step]:
        self._check_ready()
        self._stop_producer()
        return self._steps(self._start_producer())  # prefetching starts now, not at the first next()

    def set_current_version(self, version: str | int) -> None:
        """The trainer's policy version; steps planned from now on filter staleness against it."""
        threshold = None
        if self.config.max_staleness is not None:
            threshold = _parse_version(version, "current_version") - self.config.max_staleness
        self._version.current = _Version(str(version), threshold)  # one assignment: read unlocked by the producer

    @property
    def current_version(self) -> str | None:
        return self._version.current.text

    def close(self) -> None:
        """Stop the background threads (iteration can start again later from the cursor)."""
        self._stop_producer()
        self._held = {}
        self._close_streams()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_producer", None) is not None:
            self._producer.close()
        self._close_streams()

    # -- internals ----------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self.config.max_staleness is not None and self._version.current.threshold is None:
            raise ValueError(
                "max_staleness needs the policy version: set LoaderConfig.current_version or call set_current_version()"
            )

    def _close_streams(self) -> None:
        raise NotImplementedError

    def _produce(self) -> Callable[[threading.Event], Iterator[_Item]]:
        raise NotImplementedError

    def _start_producer(self) -> _Background:
        self._producer = _Background(self._produce(), self.config.prefetch, f"rollshard-loader-steps-{self.rank}")
        return self._producer

    def _stop_producer(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None

    def _steps(self, producer: _Background) -> Iterator[Step]:
        try:
            while True:
                if self._producer is not producer:
                    raise RuntimeError("this loader iterator was replaced by a newer iter() or load_state_dict()")
                item = producer.get()
                if item is _END:
                    return
                if not item.segment.holds_for(self._version.current.threshold):
                    # the policy version moved past a staleness decision of this prefetched step: re-plan it
                    producer.close()
                    producer = self._start_producer()
                    continue
                self._cursor, self._epoch_counts = item.cursor, item.epoch_counts
                if item.step is None:
                    self.epoch_stats = {k: float(v) for k, v in item.epoch_counts.items()}
                    continue
                yield item.step
        finally:
            if self._producer is producer:
                self._stop_producer()
                self._held = {}


def check_state_header(state: Any, expected: str) -> None:
    """Raise :class:`LoaderStateError` unless ``state`` is a loader state of format ``expected`` that this rollshard
    reads."""
    if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, MIXTURE_STATE_FORMAT):
        raise LoaderStateError("not a rollshard loader state (no 'format': 'rollshard-loader')")
    if state["format"] != expected:
        if expected == STATE_FORMAT:
            names = ", ".join(s.get("name", "?") for s in state.get("sources") or [])
            raise LoaderStateError(
                f"loader state is of a mixture of sources {names}, this loader reads one dataset: the source list "
                "changed; resume with the --data of the checkpoint"
            )
        raise LoaderStateError(
            f"loader state is of one dataset (dataset={state.get('dataset')!r}), this loader mixes several sources: "
            "the source list changed; resume with the --data of the checkpoint"
        )
    if not isinstance(state.get("version"), int):
        raise LoaderStateError(f"loader state has no integer 'version' (format {expected!r})")
    if state["version"] > STATE_VERSION:
        raise LoaderStateError(
            f"loader state version {state['version']} is newer than this rollshard's {STATE_VERSION}; upgrade rollshard"
        )


def check_state_settings(state: dict, mine: dict) -> None:
    """Raise :class:`LoaderStateError` naming the first setting the order depends on that differs."""
    why = {
        "world_size": "the data-parallel split depends on it; resume with the world size of the checkpoint",
        "seed": "the order depends on it; resume with the seed of the checkpoint",
        "dataset": "its shards were added, removed or rewritten since the checkpoint; resume on the same shards "
        "or start a new run",
        "shuffle": "the order depends on it",
    }
    if mine["shuffle"]:
        why["shuffle_window"] = "the order depends on it"
    for key, reason in why.items():
        if key in mine and state.get(key) != mine[key]:
            raise LoaderStateError(
                f"loader state has {key}={state.get(key)!r}, this loader {key}={mine[key]!r}: {reason}"
            )


class RolloutLoader(_StepLoader):
    """Iterable of :class:`Step`: whole GRPO groups of one rank, packed; see the module docstring.

    Iterating continues from the cursor (a new ``iter()`` picks up where the last step
    taken left off); with ``num_epochs=E`` the loader stops after E epochs in all.
    The cursor is the same on every rank, so a checkpoint may keep rank 0's state and
    load it on every rank. Call :meth:`close` (or use ``with``) to stop the threads early.
    """

    def __init__(
        self,
        dataset: RolloutDataset | str | os.PathLike,
        config: LoaderConfig | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
    ):
        config = self._set_placement(config, rank, world_size)
        self.dataset = dataset if isinstance(dataset, RolloutDataset) else RolloutDataset.open(dataset)
        self._stream = open_stream(self.dataset, config, rank, world_size)
        self.num_groups = self._stream.num_groups
        self._cursor = _Cursor()
        self._epoch_counts: dict[str, int] = {}
        self._init_common()

    def state_dict(self) -> dict:
        """The cursor after the last step taken, and what it is valid for (JSON-serializable)."""
        c = self._cursor
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.config.seed,
            "dataset": self.dataset.fingerprint,
            "shuffle": self.config.shuffle,
            "shuffle_window": self.config.shuffle_window,
            "epoch": c.epoch,
            "cursor": {"position": c.position, "step": c.step},
            "current_version": self._version.current.text,
            "epoch_counts": dict(self._epoch_counts),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at the step after the one the state was taken at; raises :class:`LoaderStateError` on a mismatch."""
        check_state_header(state, STATE_FORMAT)
        check_state_settings(state, self.state_dict())
        self._stop_producer()
        self._cursor = _Cursor(state["epoch"], state["cursor"]["position"], state["cursor"]["step"])
        self._epoch_counts = dict(state.get("epoch_counts") or {})
        if state.get("current_version") is not None:
            self.set_current_version(state["current_version"])

    # -- internals ----------------------------------------------------------------------------

    def _check_ready(self) -> None:
        super()._check_ready()
        if self.config.num_epochs is None and self.num_groups == 0:
            raise ValueError(f"{self.dataset.storage.uri}: the dataset has no groups to loop over")

    def _close_streams(self) -> None:
        if getattr(self, "_stream", None) is not None:
            self._stream.checksums.close()

    def _produce(self) -> Callable[[threading.Event], Iterator[_Item]]:
        # the thread holds the stream and a view of the version, never the loader, so an abandoned loader is freed
        stream, start, counts, version = self._stream, self._cursor, dict(self._epoch_counts), self._version
        preloaded, held = dict(self._held), {}  # copied here: a producer that outlived close() cannot touch it
        self._held = held
        return lambda stop: stream.items(start, counts, preloaded, held, version, stop)


def open_stream(dataset: RolloutDataset, config: LoaderConfig, rank: int, world_size: int) -> _Stream:
    """The group stream of one dataset (its blocks scanned and checked); the machinery a mixture draws from."""
    return _Stream(dataset, _scan_blocks(dataset, check_types=config.verify_data), config, rank, world_size)


# -- HF datasets -----------------------------------------------------------------------------


HF_GROUP_SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("sample_id", pa.list_(pa.string())),
        ("agent", pa.list_(pa.string())),
        ("weight_version", pa.list_(pa.string())),
        ("reward", pa.list_(pa.float32())),
        ("temperature", pa.list_(pa.float32())),
        ("prompt_tokens", pa.list_(pa.list_(pa.int32()))),
        ("response_tokens", pa.list_(pa.list_(pa.int32()))),
        ("rollout_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("loss_mask", pa.list_(pa.list_(pa.uint8()))),
        # schema 1.1, per row (None for a row without a support, every row of a 1.0 shard)
        ("sampling_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("sampling_support", pa.list_(pa.list_(pa.list_(pa.int32())))),
    ]
)


def hf_groups(dataset: RolloutDataset | str | os.PathLike, config: LoaderConfig | None = None):
    """The loader's groups as a HF ``datasets.IterableDataset``, one example per group.

    The same row and group filters as :class:`RolloutLoader` (staleness against
    ``config.current_version``), in shard order. Each shard file is one HF shard, so
    ``datasets.distributed.split_dataset_by_node`` keeps groups whole: it hands out whole
    shards when their number divides by the world size, and every world_size-th group
    otherwise. Shuffling (``.shuffle(seed, buffer_size)``), batching and packing are then
    HF's and the user's; HF's resume of a shuffled stream is not exact. Each shard is checked
    as the loader checks it (with ``verify_data``), its sha256 before its first group is yielded.
    """
    import datasets

    ds = dataset if isinstance(dataset, RolloutDataset) else RolloutDataset.open(dataset)
    if not ds.storage.local:
        raise ValueError("hf_groups reads local datasets; for remote ones use RolloutLoader")
    cfg = dataclasses.asdict(config or LoaderConfig())
    if cfg["max_staleness"] is not None and cfg["current_version"] is None:
        raise ValueError("max_staleness needs LoaderConfig.current_version")
    return datasets.IterableDataset.from_generator(
        _hf_generate,
        features=datasets.Features.from_arrow_schema(HF_GROUP_SCHEMA),
        # one list entry per shard: HF splits gen_kwargs lists into its shards
        gen_kwargs={"shards": [dataclasses.asdict(s) for s in ds.shards], "root": ds.storage.root, "config": cfg},
    )


def _hf_generate(shards: list[dict], root: str, config: dict) -> Iterator[dict]:
    cfg = LoaderConfig(**config)
    filters = _Filters.of(cfg)
    threshold = None
    if cfg.max_staleness is not None:
        threshold = _parse_version(cfg.current_version, "current_version") - cfg.max_staleness
    storage = Storage(root)
    for info in map(lambda d: ShardInfo(**d), shards):
        f, pf = open_shard(storage, info)
        with f:
            if cfg.verify_data:
                check_column_types(pf.schema_arrow, SMALL_COLUMNS + TOKEN_COLUMNS + SAMPLING_COLUMNS, info.path)
                verify_sha256(storage, info)  # whole before its first group: HF has no step to hold back
            yield from _hf_shard_groups(pf, info.path, filters, threshold, cfg.verify_data)


def _hf_shard_groups(pf: pq.ParquetFile, shard: str, filters: _Filters, threshold, check: bool) -> Iterator[dict]:
    try:
        blocks = _shard_blocks(pf)[0]
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{shard}: cannot read its group ids: {_one_line(e)}") from e
    for rgs, n in blocks:
        bd = _read_block(pf, _Block(shard=-1, row_groups=rgs, num_groups=n), filters, shard, check)
        seg = _Segment(threshold, filters)
        for j in range(len(bd.group_ids)):
            rows = seg.examine(bd, j)
            if rows is None:
                continue
            rows = rows.tolist()
            yield {
                "group_id": bd.group_ids[j],
                "sample_id": [bd.sample_id[r] for r in rows],
                "agent": [bd.agent[r] for r in rows],
                "weight_version": [bd.weight_version[r] for r in rows],
                "reward": bd.reward[rows].tolist(),
                "temperature": bd.temperature[rows].tolist(),
                **{name: [bd.row_tokens(name, r).tolist() for r in rows] for name in TOKEN_COLUMNS},
                "sampling_logprobs": [None if bd.row_support(r) is None else bd.row_tokens("sampling_logprobs", r).tolist()
                                      for r in rows],
                "sampling_support": [bd.row_support_lists(r) for r in rows],
            }

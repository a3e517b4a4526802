"""The dataset's blocks, built when a loader opens it: the units every rank's share is dealt in.

A block is a Parquet row group, or several consecutive row groups of one shard when a group
spans them; it holds whole groups. Building them needs, per row group, which groups it holds:
the manifest lists it (``ShardInfo.row_groups``, written by the writer at commit: rows, tokens
and the 64-bit hashes of its group ids), so opening reads no row group data; a shard whose entry
does not (an older manifest) has its ``group_id`` column scanned instead, row group by row group.

The same hashes check the writer's contract that a group never spans shards: a hash in two
shards is confirmed on the ids themselves (only those shards' ``group_id`` column is read), so a
collision of two ids cannot raise. Memory: one 8-byte hash per group while the dataset opens.

Each block carries a weight, what the ranks' shares are balanced by: its tokens when every shard's
manifest entry lists its row groups, else (an older dataset) its compressed bytes, from the footer.
"""

from __future__ import annotations

import collections
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.common import DataError, one_line
from rollshard.store.io.integrity import check_column_types, open_shard
from rollshard.store.loader.config import SAMPLING_COLUMNS, SCAN_THREADS, SMALL_COLUMNS, TOKEN_COLUMNS
from rollshard.store.format.manifest import group_hash
from rollshard.store.format.routing import ROUTING_COLUMN


@dataclasses.dataclass(frozen=True)
class Block:
    """Row groups of one shard that hold whole groups (one row group unless a group spans several)."""

    shard: int
    row_groups: tuple[int, ...]
    num_groups: int
    weight: int = 0  # tokens, or compressed bytes (module docstring): what the ranks' shares balance


@dataclasses.dataclass
class _Scanned:
    """One shard's row groups: the hashes of each one's group ids, and each one's weight."""

    hashes: list[np.ndarray]  # [row groups] of [groups in it] int64
    weights: list[int]  # [row groups] tokens, or compressed bytes when ``tokens`` is False
    tokens: bool


def open_dataset_shard(dataset: RolloutDataset, shard: int) -> tuple[Any, pq.ParquetFile]:
    """Size and schema version at every open; the footer read again unless the manifest records its sha256 (the
    checks then verify its bytes, store/io/integrity.py)."""
    info = dataset.shards[shard]
    return open_shard(dataset.storage, info, dataset.footer(shard) if info.has_ranges else None)


def hash_group_ids(group_ids: list[str]) -> np.ndarray:
    return np.frombuffer(group_hash(group_ids), "<i8") if group_ids else np.zeros(0, np.int64)


def shard_blocks(hashes: list[np.ndarray]) -> list[tuple[tuple[int, ...], int]]:
    """Blocks of one shard as (row groups, group count), from the group hashes of each row group."""
    n = len(hashes)
    if n == 0:
        return []
    flat = np.concatenate(hashes)
    rg = np.repeat(np.arange(n), [len(h) for h in hashes])
    uniq, first_at, inverse = np.unique(flat, return_index=True, return_inverse=True)
    first, last = rg[first_at], np.zeros(len(uniq), np.int64)
    np.maximum.at(last, inverse, rg)
    reach = np.arange(n)  # reach[i]: last row group holding a group that starts in row group i
    np.maximum.at(reach, first, last)
    starts = np.bincount(first, minlength=n)
    blocks, s = [], 0
    while s < n:
        end, i = int(reach[s]), s
        while i <= end:
            end, i = max(end, int(reach[i])), i + 1
        blocks.append((tuple(range(s, end + 1)), int(starts[s : end + 1].sum())))
        s = end + 1
    return blocks


def read_group_ids(pf: pq.ParquetFile, where: str, row_groups=None) -> list[list[str]]:
    """The group ids of each row group (``row_groups``: those only), in order of first appearance."""
    try:
        return [pc.unique(pf.read_row_group(rg, columns=["group_id"]).column(0)).to_pylist()
                for rg in (range(pf.metadata.num_row_groups) if row_groups is None else row_groups)]
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{where}: cannot read its group ids: {one_line(e)}") from e


def _scan_shard(dataset: RolloutDataset, i: int, check_types: bool) -> _Scanned:
    shard, footer = dataset.shards[i], dataset.footer(i)
    if check_types:
        columns = SMALL_COLUMNS + TOKEN_COLUMNS + SAMPLING_COLUMNS + [ROUTING_COLUMN]
        check_column_types(footer.schema.to_arrow_schema(), columns, shard.path)
    if shard.row_groups is not None:  # the manifest's: nothing to read (open_shard checked them against the footer)
        hashes = [np.frombuffer(bytes.fromhex(r.group_hashes), "<i8") for r in shard.row_groups]
        return _Scanned(hashes=hashes, weights=[r.tokens for r in shard.row_groups], tokens=True)
    f, pf = open_dataset_shard(dataset, i)
    with f:
        ids = read_group_ids(pf, shard.path)
    return _Scanned(hashes=[hash_group_ids(g) for g in ids], weights=_compressed_bytes(footer), tokens=False)


def _compressed_bytes(footer: pq.FileMetaData) -> list[int]:
    out = []
    for r in range(footer.num_row_groups):
        rg = footer.row_group(r)
        out.append(sum(rg.column(c).total_compressed_size for c in range(rg.num_columns)))
    return out


def scan_blocks(dataset: RolloutDataset, check_types: bool = True) -> list[Block]:
    """Every block of the dataset; raises when a group has rows in two shards."""
    n = len(dataset.shards)
    if all(s.row_groups is not None for s in dataset.shards):  # no file to open: no thread to start
        scanned = [_scan_shard(dataset, i, check_types) for i in range(n)]
    else:
        with ThreadPoolExecutor(max_workers=min(SCAN_THREADS, max(1, n))) as pool:
            scanned = list(pool.map(lambda i: _scan_shard(dataset, i, check_types), range(n)))
    per_shard = [np.unique(np.concatenate(s.hashes)) if s.hashes else np.zeros(0, np.int64) for s in scanned]
    flat = np.concatenate(per_shard) if per_shard else np.zeros(0, np.int64)
    uniq, counts = np.unique(flat, return_counts=True)
    if (counts > 1).any():
        _raise_split_groups(dataset, scanned, uniq[counts > 1])
    by_tokens = all(s.tokens for s in scanned)
    out = []
    for i, s in enumerate(scanned):
        weights = s.weights if by_tokens else (s.weights if not s.tokens else _compressed_bytes(dataset.footer(i)))
        for rgs, ng in shard_blocks(s.hashes):
            out.append(Block(shard=i, row_groups=rgs, num_groups=ng, weight=int(sum(weights[r] for r in rgs))))
    return out


def _raise_split_groups(dataset: RolloutDataset, scanned: list[_Scanned], suspects: np.ndarray) -> None:
    """Raise for a group with rows in two shards, reading the ids of the row groups whose hashes repeat."""
    where: dict[str, list[str]] = collections.defaultdict(list)
    for i, s in enumerate(scanned):
        rgs = [r for r, h in enumerate(s.hashes) if np.isin(h, suspects).any()]
        if not rgs:
            continue
        f, pf = open_dataset_shard(dataset, i)
        with f:
            ids = {g for gs in read_group_ids(pf, dataset.shards[i].path, rgs) for g in gs}
        for g in sorted(ids):
            where[g].append(dataset.shards[i].path)
    split = {g: paths for g, paths in where.items() if len(paths) > 1}
    if split:  # otherwise two ids only shared a 64-bit hash
        g, paths = next(iter(split.items()))
        raise ValueError(
            f"group {g!r} has rows in shards {', '.join(paths)} ({len(split)} groups span shards); a GRPO group must "
            "lie in one shard: write every group with one ShardWriter.write_group call"
        )



"""Dataset validation: re-check every promise a dataset's manifests and schema make.

``rollshard-store validate`` runs a :class:`Validator` over a dataset directory. Per
shard it checks, in order of cost:

* the file exists, and its size and sha256 equal the manifest entry, and (manifest version 3)
  each row group's byte range and the footer hash as the manifest records (what the loader checks
  block by block), and (version 4) their XXH3-128 too, which the loader checks instead, all in one
  read of the file;
* the file is readable Parquet of a schema major this rollshard reads (a newer major
  is refused with the version it needs) whose columns and types are those of schema v1
  (a 1.0 shard lacks the two sampling columns of 1.1: read as nulls; one of them alone is a
  problem);
* row group by row group (memory stays bounded by one row group): every row invariant
  of :func:`rollshard.store.format.invariants.check_table`, and the row, group, prompt-token and
  response-token counts against the manifest, and each row group's rows, tokens and
  group-id hashes against the manifest's ``row_groups`` when it lists them.

Across shards: no shard is listed twice, a GRPO group lives in one shard only, and
every ``sample_id`` is unique in the whole dataset. These keep a 64-bit hash per row
and per (shard, group) (8 bytes each) and re-read the one id column only to name the
culprits when a hash repeats, so a hash collision cannot cause a false report.

Shard files no manifest lists (a writer crashed between rename and manifest update)
are warnings, not problems: readers ignore them, and reopening that writer adopts them.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter, defaultdict
from typing import Any, Callable

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from rollshard.store.common import one_line
from rollshard.store.io.dataset import DatasetNotFoundError
from rollshard.store.io.integrity import file_digests
from rollshard.store.format.invariants import check_table
from rollshard.store.format.manifest import MANIFEST_DIR, SHARD_DIR, ShardInfo, read_manifest
from rollshard.store.format.routing import RoutingShape
from rollshard.store.format.schema import (
    ADDED_COLUMNS,
    OPTIONAL_COLUMNS,
    ROW_SCHEMA,
    SchemaVersionError,
    cast_table,
    check_schema_version,
    config_of,
)
from rollshard.store.io.storage import Storage
from rollshard.store.io.writer import list_values_total, row_group_info

HASH_SEED = 0x5EED  # any fixed seed: hashes are compared within one run only
PROBLEMS_PER_SHARD = 20  # invariant breaks listed per shard; the count of the rest is reported


@dataclasses.dataclass(frozen=True)
class Issue:
    """One problem found; ``shards`` are dataset-relative paths (empty: the dataset as a whole)."""

    check: str  # missing, size, sha256, unreadable, schema_version, schema, invariant, rows, ...
    detail: str
    shards: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "detail": self.detail, "shards": list(self.shards)}


@dataclasses.dataclass
class ShardReport:
    path: str
    writer_id: str
    rows: int  # as the manifest records it
    bytes: int
    problems: list[Issue] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "writer_id": self.writer_id,
            "rows": self.rows,
            "bytes": self.bytes,
            "ok": self.ok,
            "problems": [{"check": p.check, "detail": p.detail} for p in self.problems],
        }


@dataclasses.dataclass
class ValidationReport:
    dataset: str
    shards: list[ShardReport]
    dataset_problems: list[Issue]
    warnings: list[str]

    @property
    def problems(self) -> list[Issue]:
        """Every problem: per-shard ones tagged with their shard, then the dataset-wide ones."""
        per_shard = [dataclasses.replace(p, shards=(s.path,)) for s in self.shards for p in s.problems]
        return per_shard + self.dataset_problems

    @property
    def ok(self) -> bool:
        return not self.dataset_problems and all(s.ok for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "ok": self.ok,
            "num_shards": len(self.shards),
            "num_problems": len(self.problems),
            "shards": [s.to_dict() for s in self.shards],
            "dataset_problems": [p.to_dict() for p in self.dataset_problems],
            "warnings": self.warnings,
        }


class Validator:
    """Open a dataset's manifests (raises :class:`DatasetNotFoundError` when there are none),
    then :meth:`check_shard` each of :attr:`shards` and :meth:`finish`."""

    def __init__(self, path: str | os.PathLike | Storage):
        self.storage = path if isinstance(path, Storage) else Storage(path)
        self.dataset_problems: list[Issue] = []
        manifest_files = self.storage.list(MANIFEST_DIR, ".json")
        if not manifest_files:
            raise DatasetNotFoundError(
                f"{self.storage.uri}: no rollshard dataset here (no {MANIFEST_DIR}/*.json); check the path"
            )
        manifests = []
        for rel in manifest_files:
            try:
                manifests.append(read_manifest(self.storage, rel, rel))
            except ValueError as e:
                self.dataset_problems.append(Issue("manifest", str(e)))
        listed = Counter(s.path for m in manifests for s in m.shards)
        for path, n in sorted(listed.items()):
            if n > 1:
                self.dataset_problems.append(Issue("manifest", f"listed {n} times in the manifests", (path,)))
        seen: set[str] = set()
        self.shards: list[ShardInfo] = []
        for s in sorted((s for m in manifests for s in m.shards), key=lambda s: s.path):
            if s.path not in seen:
                seen.add(s.path)
                self.shards.append(s)
        self.reports: list[ShardReport] = []
        self._row_hashes: list[np.ndarray] = []  # [rows of shard i] uint64, per checked shard
        self._group_hashes: list[np.ndarray] = []  # [unique groups of shard i] uint64
        self._hashed_paths: list[str] = []

    def check_shard(self, shard: ShardInfo) -> ShardReport:
        report = ShardReport(shard.path, shard.writer_id, shard.rows, shard.bytes)
        self.reports.append(report)
        problem = lambda check, detail: report.problems.append(Issue(check, detail))  # noqa: E731
        if not self.storage.exists(shard.path):
            problem("missing", "the manifest lists this shard but the file is not there")
            return report
        size = self.storage.size(shard.path)
        if size != shard.bytes:
            problem("size", f"{size} bytes on disk, the manifest says {shard.bytes}")
        ranges = [(r.offset, r.length) for r in shard.row_groups] if shard.has_ranges else None
        got = file_digests(self.storage, shard.path, ranges, xxh3=shard.has_fast_hashes)
        if got.sha256 != shard.sha256:
            problem("sha256", f"checksum {got.sha256[:16]}... differs from the manifest's {shard.sha256[:16]}...")
        if ranges is not None:  # what the loader checks block by block: the manifest's ranges must hash as recorded
            bad = [i for i, (d, r) in enumerate(zip(got.ranges, shard.row_groups)) if d != r.sha256]
            if bad:
                problem("ranges", f"row group {bad[0]} (bytes {ranges[bad[0]][0]}-{sum(ranges[bad[0]])}): sha256 differs "
                                  f"from the manifest's ({len(bad)} row groups differ)")
            if got.footer != shard.footer_sha256:
                problem("ranges", "footer: sha256 differs from the manifest's footer_sha256")
        if got.ranges_xxh3 is not None:  # the loader checks these instead: bytes that pass the sha256 must pass them
            bad = [i for i, (d, r, x) in enumerate(zip(got.ranges, shard.row_groups, got.ranges_xxh3))
                   if d == r.sha256 and x != r.xxh3]
            if bad:
                problem("ranges", f"row group {bad[0]}: the manifest's xxh3 differs from the bytes its sha256 matches "
                                  f"({len(bad)} row groups); the loader would refuse them")
            if got.footer == shard.footer_sha256 and got.footer_xxh3 != shard.footer_xxh3:
                problem("ranges", "footer: the manifest's footer_xxh3 differs from the bytes its footer_sha256 matches")
        try:
            with self.storage.fs.open_input_file(self.storage.path(shard.path)) as f:
                self._check_content(pq.ParquetFile(f), shard, problem)
        except SchemaVersionError as e:
            problem("schema_version", str(e))
        except (OSError, pa.ArrowException) as e:
            problem("unreadable", f"not readable as Parquet: {one_line(e)}")
        return report

    def finish(self) -> ValidationReport:
        """Cross-shard checks over what :meth:`check_shard` saw; the full report."""
        self._check_duplicates()
        known = {s.path for s in self.shards}
        warnings = [
            f"{rel}: not in any manifest (a writer stopped between rename and manifest update); "
            "readers ignore it, reopening that writer adopts it"
            for rel in self.storage.list(SHARD_DIR, ".parquet")
            if rel not in known
        ]
        return ValidationReport(self.storage.uri, self.reports, self.dataset_problems, warnings)

    # -- internals --------------------------------------------------------------------------

    def _check_content(self, pf: pq.ParquetFile, shard: ShardInfo, problem: Callable[[str, str], None]) -> None:
        check_schema_version(pf.schema_arrow.metadata, shard.path)
        try:
            routing = RoutingShape.from_config(config_of(pf.schema_arrow.metadata))
        except ValueError as e:  # a routing entry rollshard cannot use: the shard's routing goes unchecked
            problem("schema", f"run config: {e}")
            routing = None
        expected = {f.name: f.type for f in ROW_SCHEMA}
        got = {f.name: f.type for f in pf.schema_arrow}
        # A shard of an older 1.x schema lacks the optional columns (read as nulls); the sampling pair comes whole.
        missing = [n for n in expected if n not in got and n not in ADDED_COLUMNS]
        alone = [n for n in OPTIONAL_COLUMNS if n in got]
        if len(alone) == 1:
            missing.append(next(n for n in OPTIONAL_COLUMNS if n not in got))
        wrong = [f"{n} is {got[n]}, not {t}" for n, t in expected.items() if n in got and got[n] != t]
        if missing or wrong:
            problem("schema", "; ".join(([f"lacks columns {missing}"] if missing else []) + wrong))
            if missing:
                return
        rows = prompt_tokens = response_tokens = 0
        row_hashes, group_hashes, n_invariant, recorded_rgs = [], [], 0, []
        for i in range(pf.num_row_groups):
            try:
                table = cast_table(pf.read_row_group(i))
            except ValueError as e:
                problem("schema", f"row group {i}: {e}")
                return
            for p in check_table(table, limit=PROBLEMS_PER_SHARD, routing=routing):
                if p.field == "sample_id" and p.detail == "appears more than once":
                    continue  # the dataset-wide duplicate check reports these, with the shards
                n_invariant += 1
                if n_invariant <= PROBLEMS_PER_SHARD:
                    problem("invariant", f"row group {i}: {p.message()}")
            rows += table.num_rows
            prompt_tokens += list_values_total(table.column("prompt_tokens"))
            response_tokens += list_values_total(table.column("response_tokens"))
            row_hashes.append(_hash(table.column("sample_id")))
            group_hashes.append(np.unique(_hash(table.column("group_id"))))
            recorded_rgs.append(row_group_info(table))
        if n_invariant > PROBLEMS_PER_SHARD:
            problem("invariant", f"... {n_invariant - PROBLEMS_PER_SHARD} more invariant breaks in this shard")
        groups = np.unique(np.concatenate(group_hashes)) if group_hashes else np.zeros(0, np.uint64)
        for name, actual, recorded in (
            ("rows", rows, shard.rows),
            ("groups", len(groups), shard.groups),
            ("prompt_tokens", prompt_tokens, shard.prompt_tokens),
            ("response_tokens", response_tokens, shard.response_tokens),
        ):
            if actual != recorded:
                problem(name, f"the shard holds {actual}, the manifest says {recorded}")
        listed = None if shard.row_groups is None else [r.content() for r in shard.row_groups]
        recorded_rgs = [r.content() for r in recorded_rgs]
        if listed is not None and recorded_rgs != listed:
            bad = next((i for i, (a, b) in enumerate(zip(recorded_rgs, listed)) if a != b),
                       min(len(recorded_rgs), len(shard.row_groups)))
            problem("row_groups", f"row group {bad}: its rows, tokens or group ids are not the manifest's row_groups "
                                  f"entry ({len(recorded_rgs)} row groups in the file, {len(shard.row_groups)} listed)")
        self._hashed_paths.append(shard.path)
        self._row_hashes.append(np.concatenate(row_hashes) if row_hashes else np.zeros(0, np.uint64))
        self._group_hashes.append(groups)

    def _check_duplicates(self) -> None:
        """sample_id unique across the dataset; each group in one shard only."""
        for column, hashes, check in (
            ("sample_id", self._row_hashes, "duplicate_sample_id"),
            ("group_id", self._group_hashes, "split_group"),
        ):
            suspects = _repeated(hashes)
            if not suspects.size:
                continue
            # Name the culprits from the real ids: a hash collision is not a duplicate.
            where: dict[str, Counter] = defaultdict(Counter)
            for path, h in zip(self._hashed_paths, hashes):
                if not np.isin(h, suspects).any():
                    continue
                with self.storage.fs.open_input_file(self.storage.path(path)) as f:
                    ids = pq.read_table(f, columns=[column]).column(column)
                for value in np.asarray(ids.to_pylist(), dtype=object)[np.isin(_hash(ids), suspects)]:
                    where[value][path] += 1
            for value, shards in sorted(where.items()):
                if check == "split_group" and len(shards) > 1:
                    detail = f"group {value!r} is split across {len(shards)} shards; a group must stay in one shard"
                elif check == "duplicate_sample_id" and sum(shards.values()) > 1:
                    detail = f"sample_id {value!r} appears {sum(shards.values())} times"
                else:
                    continue
                self.dataset_problems.append(Issue(check, detail, tuple(sorted(shards))))


def validate_dataset(
    path: str | os.PathLike | Storage, *, on_shard: Callable[[ShardReport], None] | None = None
) -> ValidationReport:
    """Validate a whole dataset; ``on_shard`` is called after each shard (progress)."""
    v = Validator(path)
    for shard in v.shards:
        report = v.check_shard(shard)
        if on_shard is not None:
            on_shard(report)
    return v.finish()


def _hash(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return pl.Series(column).hash(seed=HASH_SEED).to_numpy()  # [rows] uint64


def _repeated(chunks: list[np.ndarray]) -> np.ndarray:
    """Values that occur more than once in the concatenation of ``chunks``."""
    if not chunks:
        return np.zeros(0, np.uint64)
    values, counts = np.unique(np.concatenate(chunks), return_counts=True)
    return values[counts > 1]

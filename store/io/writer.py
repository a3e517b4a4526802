"""The shard writer: whole GRPO groups in, committed Parquet shards and a manifest out.

Rows are buffered up to ``row_group_bytes`` (Arrow memory) and flushed as one Parquet
row group; a shard is committed (fsync, rename, manifest rewritten) when it reaches
``shard_bytes`` on disk, on :meth:`ShardWriter.commit` and on :meth:`ShardWriter.close`.
Groups are the unit: :meth:`ShardWriter.write_group` takes every row of one group, so
a group never spans two shards and a crash loses whole groups only.

Leaving a ``with`` block on an exception discards the shard being written; shards
committed before stay committed. A writer re-opened with the same ``writer_id``
continues its manifest, and adopts a shard that a crash left renamed but not yet in
the manifest (the rename happens after fsync, so such a shard is complete).

Settings (measured in tests/bench/bench_store.py, see the README): zstd level 1 and
no dictionary encoding on the list columns (token ids are high-cardinality; the
dictionary pages are dead weight) while the short string columns keep it.

Every shard is written with the current schema (1.1): the sampling columns are always
there, null for rows without a support. A row group is cut by the bytes of the data, not
counting an all-null sampling column, so rows without supports are grouped as before.

Each manifest entry lists its shard's row groups (rows, tokens, group-id hashes;
:class:`~rollshard.store.format.manifest.RowGroupInfo`), so that a loader opens the dataset without
reading row group data, and each row group's byte range with its sha256 and its XXH3-128 (and the
footer's two), hashed from the bytes as they are written, which the loader checks one block at a time.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import socket
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from rollshard.store.common import utc_now
from rollshard.store.io.integrity import MAGIC, file_digests, row_group_ranges
from rollshard.store.format.invariants import check_table
from rollshard.store.format.manifest import SHARD_DIR, WRITER_ID_RE, Manifest, RowGroupInfo, ShardInfo, group_hash
from rollshard.store.format.routing import RoutingShape
from rollshard.store.format.schema import (
    LIST_COLUMNS,
    ROW_SCHEMA,
    Row,
    RowInvariantError,
    cast_table,
    check_schema_version,
    data_bytes,
    file_metadata,
    rows_to_table,
)
from rollshard.store.io.s3 import PreconditionFailed, S3Error
from rollshard.store.io.storage import HashingFile, PendingFile, Storage, TMP_DIR

DICTIONARY_COLUMNS = [n for n in ROW_SCHEMA.names if n not in LIST_COLUMNS]


@dataclasses.dataclass(kw_only=True)
class WriterOptions:
    """Parquet and commit settings of a :class:`ShardWriter`."""

    compression: str = "zstd"
    compression_level: int | None = 1
    row_group_bytes: int = 64 << 20  # Arrow bytes buffered before a row group is written
    shard_bytes: int = 512 << 20  # a shard is committed once this many bytes are on disk
    dictionary_lists: bool = False  # dictionary-encode the list columns too (measured: worse)
    validate: bool = True  # check every invariant before a row is buffered
    lease_seconds: float | None = None  # S3: the term of the writer id's lease (store/io/s3.py; None: its default)
    lease_wait_seconds: float | None = None  # S3: how long to watch a lease held elsewhere lapse (None: one term)


def default_writer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class ShardWriter:
    """Writes whole GRPO groups of rows into a dataset directory; see the module docstring."""

    def __init__(
        self,
        dataset: str | os.PathLike | Storage,
        *,
        writer_id: str | None = None,
        config: dict[str, Any] | None = None,
        options: WriterOptions | None = None,
    ):
        self.storage = dataset if isinstance(dataset, Storage) else Storage(dataset)
        self.writer_id = writer_id or default_writer_id()
        if not WRITER_ID_RE.match(self.writer_id):
            raise ValueError(
                f"writer id {self.writer_id!r} must be 1-128 characters of letters, digits, '_', '.', '-'"
            )
        self.options = options or WriterOptions()
        self.config = config or {}
        self._schema = ROW_SCHEMA.with_metadata(file_metadata(self.config))
        self._routing = RoutingShape.from_config(self.config)  # schema 1.2: the routed_experts column's shape
        self.storage.makedirs(SHARD_DIR)
        rel = Manifest.rel_path(self.writer_id)
        self._claim = self.storage.claim(self.writer_id, rel, lease_seconds=self.options.lease_seconds,
                                         lease_wait_seconds=self.options.lease_wait_seconds)
        try:
            data = self._claim.load_manifest()
            existing = None if data is None else Manifest.from_json(data, self.storage.path(rel))
            self.manifest = existing or Manifest(writer_id=self.writer_id)
            self.manifest.config = self.config or self.manifest.config
            # The dataset exists (empty) from the moment a writer opens it. A writer id taken over from a dead
            # process is written at once, so that process cannot commit behind this one's back (S3's fencing).
            if existing is None or self._claim.took_over:
                self.save_manifest()
            self._adopt_orphans()
        except BaseException:
            self._claim.release()
            raise
        self._buffer: list[pa.Table] = []
        self._buffer_bytes = 0
        self._pending: PendingFile | None = None
        self._fast: _FastHashes | None = None  # the open shard's file as Parquet writes it, XXH3 per segment
        self._pq: pq.ParquetWriter | None = None
        self._shard_stats = _Counts()
        self._row_groups: list[RowGroupInfo] = []  # of the open shard
        self._groups_written: set[str] = set()  # this session's groups: none may arrive twice
        self._closed = False

    # -- public API -------------------------------------------------------------------------

    def write_group(self, rows: Iterable[Row | dict[str, Any]] | pa.Table) -> None:
        """Buffer every row of one GRPO group; raises :class:`RowInvariantError` on a bad row."""
        table = rows if isinstance(rows, pa.Table) else rows_to_table(rows)
        table = cast_table(table)
        if table.num_rows == 0:
            return
        groups = pc.unique(table.column("group_id")).to_pylist()
        if len(groups) != 1:
            raise ValueError(f"write_group takes the rows of one group; got groups {groups[:5]}")
        self._append(table, groups)

    def write_groups(self, table: pa.Table) -> None:
        """Buffer a table holding whole groups (every row of each group present)."""
        table = cast_table(table)
        if table.num_rows:
            self._append(table, pc.unique(table.column("group_id")).to_pylist())

    def flush(self) -> None:
        """Write the buffered rows as one row group of the open shard (not yet committed)."""
        if not self._buffer:
            return
        table = pa.concat_tables(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        if self._pq is None:
            rel = f"{SHARD_DIR}/{self.writer_id}-{self._next_seq():05d}.parquet"
            self._pending = PendingFile(self.storage, rel)
            self._fast = _FastHashes(self._pending.file)
            o = self.options
            self._pq = pq.ParquetWriter(
                self._fast,
                self._schema,
                compression=o.compression,
                compression_level=o.compression_level,
                use_dictionary=True if o.dictionary_lists else DICTIONARY_COLUMNS,
                write_statistics=["sample_id", "group_id", "agent", "round", "status", "reward", "weight_version"],
            )
            self._fast.cut()  # the magic: the first row group starts here
        self._pq.write_table(table.replace_schema_metadata(self._schema.metadata), row_group_size=table.num_rows)
        self._fast.cut()  # the row group's bytes are written: its range ends here
        self._row_groups.append(row_group_info(table))
        self._buffer, self._buffer_bytes = [], 0  # only once written: a failed write loses nothing
        if self.storage.local:
            self._pending.file.sync_in_background()
        if self._pending.file.tell() >= self.options.shard_bytes:
            self.commit()

    def commit(self) -> ShardInfo | None:
        """Flush and commit the open shard: after this returns its rows survive a crash."""
        self._check_open()
        self._claim.check()  # S3: a writer whose lease was taken stops before it uploads more
        self.flush()
        if self._pq is None:
            return None
        pending, counts = self._pending, self._shard_stats
        self._pq.close()
        row_groups, self._row_groups = tuple(self._row_groups), []
        footer = self._pq.writer.metadata
        if [footer.row_group(i).num_rows for i in range(footer.num_row_groups)] != [r.rows for r in row_groups]:
            row_groups = None  # pyarrow cut a row group of its own: readers scan this shard instead
        try:
            sha, size = pending.commit()
        except PreconditionFailed as e:
            raise S3Error(f"{self.storage.uri}/{pending.rel} exists already: another process wrote it as writer "
                          f"{self.writer_id!r}; this writer stopped (what it committed stays); give each process its "
                          "own writer id (a rerun, once the other is gone, adopts that shard)") from e
        footer_sha = footer_fast = None
        if row_groups is not None:
            row_groups, footer_sha, footer_fast = with_ranges(row_groups, footer, pending.file.segments, size,
                                                              self._fast.digests())
        self._pq, self._pending, self._fast, self._shard_stats = None, None, None, _Counts()
        info = ShardInfo(
            path=pending.rel,
            rows=counts.rows,
            groups=counts.groups,
            prompt_tokens=counts.prompt_tokens,
            response_tokens=counts.response_tokens,
            bytes=size,
            sha256=sha,
            writer_id=self.writer_id,
            created_at=utc_now(),
            row_groups=row_groups,
            footer_sha256=footer_sha,
            footer_xxh3=footer_fast,
        )
        self.manifest.shards.append(info)
        self.save_manifest()
        return info

    def save_manifest(self) -> None:
        """Write this writer's manifest (fenced on S3: store/io/s3.py)."""
        self._claim.save_manifest(self.manifest.to_json(owner=self._claim.token))

    def close(self) -> None:
        """Commit what is buffered and release the writer id."""
        if self._closed:
            return
        try:
            self.commit()
        finally:
            self._release()

    def abort(self) -> None:
        """Discard buffered rows and the open shard; committed shards stay."""
        if self._closed:
            return
        self._buffer, self._buffer_bytes = [], 0
        try:
            if self._pq is not None:
                try:
                    self._pq.close()
                finally:
                    self._pending.discard()
        finally:
            self._pq, self._pending, self._fast, self._row_groups = None, None, None, []
            self._release()

    @property
    def committed_shards(self) -> list[ShardInfo]:
        return list(self.manifest.shards)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals --------------------------------------------------------------------------

    def _append(self, table: pa.Table, group_ids: list[str]) -> None:
        self._check_open()
        if self.options.validate:
            problems = check_table(table, routing=self._routing)
            if problems:
                raise RowInvariantError(problems)
        repeated = self._groups_written.intersection(group_ids)
        if repeated:
            raise ValueError(
                f"group {sorted(repeated)[0]!r} was already written by writer {self.writer_id!r}; "
                "a GRPO group must be written whole, in one call"
            )
        self._groups_written.update(group_ids)
        self._shard_stats.add(table, len(group_ids))
        self._buffer.append(table)
        self._buffer_bytes += data_bytes(table)
        if self._buffer_bytes >= self.options.row_group_bytes:
            self.flush()

    def _next_seq(self) -> int:
        seqs = [int(s.path.rsplit("-", 1)[1].split(".")[0]) for s in self.manifest.shards]
        return max(seqs, default=-1) + 1

    def _adopt_orphans(self) -> None:
        """A crash between rename and manifest save leaves a complete shard outside the manifest."""
        known = {s.path for s in self.manifest.shards}
        prefix = f"{SHARD_DIR}/{self.writer_id}-"
        orphans = [
            p
            for p in self.storage.list(SHARD_DIR, ".parquet")
            if p.startswith(prefix) and p not in known and p[len(prefix):-len(".parquet")].isdigit()
        ]
        for rel in orphans:
            with self.storage.fs.open_input_file(self.storage.path(rel)) as f:
                pf = pq.ParquetFile(f)
                check_schema_version(pf.schema_arrow.metadata, self.storage.path(rel))
                counts, row_groups = _Counts(), []
                for i in range(pf.num_row_groups):
                    table = pf.read_row_group(i, columns=["group_id", "prompt_tokens", "response_tokens"])
                    counts.add(table, None)
                    row_groups.append(row_group_info(table))
                ranges = row_group_ranges(pf.metadata)
            sha, digests, footer_sha, *_ = file_digests(self.storage, rel, ranges)
            if ranges is not None:
                row_groups = [dataclasses.replace(r, offset=o, length=n, sha256=d)
                              for r, (o, n), d in zip(row_groups, ranges, digests)]
            self.manifest.shards.append(
                ShardInfo(
                    path=rel,
                    rows=counts.rows,
                    groups=len(counts.group_ids),
                    prompt_tokens=counts.prompt_tokens,
                    response_tokens=counts.response_tokens,
                    bytes=self.storage.size(rel),
                    sha256=sha,
                    writer_id=self.writer_id,
                    created_at=utc_now(),
                    row_groups=tuple(row_groups),
                    footer_sha256=footer_sha if ranges is not None else None,
                )
            )
        if orphans:
            self.save_manifest()
        # What an earlier crashed run of this writer id left unfinished is garbage: temporary files, uploads.
        mine = re.compile(rf"^{TMP_DIR}/[0-9a-f]+~{re.escape(self.writer_id)}-\d+\.parquet$")
        for rel in self.storage.list(TMP_DIR, ".parquet"):
            if mine.match(rel):
                self.storage.delete(rel)
        self._claim.clean_uploads()
        self.storage.remove_atomic_leftovers(Manifest.rel_path(self.writer_id))

    def _release(self) -> None:
        self._closed = True
        self._claim.release()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"writer {self.writer_id!r} is closed")


class _Counts:
    def __init__(self) -> None:
        self.rows = self.groups = self.prompt_tokens = self.response_tokens = 0
        self.group_ids: set[str] = set()

    def add(self, table: pa.Table, n_groups: int | None) -> None:
        self.rows += table.num_rows
        if n_groups is None:
            self.group_ids.update(table.column("group_id").to_pylist())
        else:
            self.groups += n_groups
        self.prompt_tokens += list_values_total(table.column("prompt_tokens"))
        self.response_tokens += list_values_total(table.column("response_tokens"))


def row_group_info(table: pa.Table) -> RowGroupInfo:
    """What the manifest records of one row group (manifest.RowGroupInfo)."""
    ids = pc.unique(table.column("group_id")).to_pylist()  # in order of first appearance
    tokens = list_values_total(table.column("prompt_tokens")) + list_values_total(table.column("response_tokens"))
    return RowGroupInfo(rows=table.num_rows, tokens=tokens, group_hashes=group_hash(ids).hex())


def with_ranges(row_groups: tuple[RowGroupInfo, ...], footer: pq.FileMetaData, segments: list[tuple[int, int, str]],
                size: int, fast: list[str]) -> tuple[tuple[RowGroupInfo, ...], str | None, str | None]:
    """The row groups with their byte ranges, sha256 and XXH3-128, and the footer's sha256 and XXH3-128, from the
    segments the writer cut (the magic, one per row group, the footer; ``fast``: their XXH3-128, in the same order);
    unchanged and None unless the footer's ranges are those segments and they tile the file (then readers hash
    this shard whole)."""
    ranges = row_group_ranges(footer)
    expect = [(0, len(MAGIC))] + [(o, o + n) for o, n in ranges or []]
    if (ranges is None or [s[:2] for s in segments[:-1]] != expect or segments[-1][:2] != (expect[-1][1], size)
            or len(fast) != len(segments)):
        return row_groups, None, None
    out = tuple(dataclasses.replace(r, offset=o, length=n, sha256=seg[2], xxh3=x)
                for r, (o, n), seg, x in zip(row_groups, ranges, segments[1:-1], fast[1:-1]))
    return out, segments[-1][2], fast[-1]


class _FastHashes(io.RawIOBase):
    """The shard's :class:`HashingFile` as Parquet writes it, with the XXH3-128 of each segment (the bytes between
    two :meth:`cut` calls, the same segments as the file's sha256 ones), hashed on the writer's thread as the bytes
    go by: ~6 ms a 64 MiB row group, beside the sha256 the file computes on its I/O thread."""

    def __init__(self, file: HashingFile):
        self.file = file
        self._done: list[str] = []
        self._hash = xxhash.xxh3_128()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        n = self.file.write(data)
        self._hash.update(data)
        return n

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        self.file.flush()

    def cut(self) -> None:
        self._done.append(self._hash.hexdigest())
        self._hash.reset()
        self.file.cut()

    def digests(self) -> list[str]:
        """Every segment's XXH3-128 (hex), the last one (the footer: the bytes since the last cut) included."""
        return self._done + [self._hash.hexdigest()]


def list_values_total(col: pa.ChunkedArray) -> int:
    """The number of values in a list column (its tokens), from the offsets alone."""
    total = 0
    for chunk in col.chunks:
        offsets = chunk.offsets
        total += offsets[len(offsets) - 1].as_py() - offsets[0].as_py()
    return total

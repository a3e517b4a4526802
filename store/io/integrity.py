"""Checks that a shard is the file its manifest entry committed, before any of its rows is used.

Readers (the loader, :class:`rollshard.store.io.dataset.RolloutDataset`) call these; each
raises :class:`rollshard.store.common.DataError` with one line naming the shard (its path
relative to the dataset), the row (sample id) where there is one, and the problem.

* :func:`open_shard`: the file is there, its footer reads, its schema major is one this
  rollshard reads, its size is the manifest's, and so are its row groups' row counts when the
  manifest lists them (:func:`check_row_groups`). Cheap (one footer read).
* :func:`check_column_types`: the columns a reader uses have exactly the schema's types.
  A reader that cast would turn int64 ids or float64 logprobs into the schema's types
  silently; a file that does not match was not written by rollshard's writer, whose
  other promises then do not hold either. The schema 1.1 sampling columns may be absent
  (a 1.0 shard), both together.
* :func:`check_rows`: the row invariants of :func:`rollshard.store.format.invariants.check_projection`
  on the block of columns just read.
* :func:`verify_sha256`: the file's sha256 against the manifest's. It reads the whole
  file, so the loader runs it on a background thread (:class:`Checksums`) and holds back
  every step drawn from a shard until that shard is verified. The loader uses it only for a
  shard whose manifest entry lacks the byte ranges (below).
* Per block (manifest version 3: each row group's byte range and sha256, and the footer's;
  store/format/manifest.py): :func:`verify_ranges` checks the bytes of a block's row groups that the
  loader read to decode them, :func:`verify_footer` the bytes after the last row group, both on
  the :class:`Checksums` thread. Against their XXH3-128 where the manifest records it (version 4:
  ~10x cheaper than sha256, so the check no longer competes with the decode for the cores; it
  detects damage as the sha256 does, see store/format/manifest.py), else against their sha256. With the
  4-byte magic (checked as it is) they tile the file (:func:`row_group_ranges`), so a rank
  verifies exactly the blocks it reads and every footer it opens; a damaged byte in a row group
  another rank owns is that rank's to find. The union of the ranks verifies every byte of the
  dataset each epoch; ``rollshard-store validate`` checks whole files (:func:`file_digests`).
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import sys
import threading
import weakref
from typing import Any, Callable, Iterable, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from rollshard.store.common import DataError, one_line
from rollshard.store.format.invariants import check_projection
from rollshard.store.format.manifest import ShardInfo
from rollshard.store.format.routing import RoutingShape
from rollshard.store.format.schema import (
    ADDED_COLUMNS,
    OPTIONAL_COLUMNS,
    ROW_SCHEMA,
    SCHEMA_VERSION,
    check_schema_version,
)
from rollshard.store.io.storage import Storage

__all__ = ["Checksums", "DataError", "FileDigests", "Job", "check_column_types", "check_rows", "file_digests", "open_shard",
           "row_group_ranges", "sampling_columns", "verify_footer", "verify_ranges", "verify_sha256", "verify_shard"]

READ_CHUNK = 8 << 20  # bytes hashed per read: large enough that hashlib releases the GIL and reads stream
VALIDATE = "run `rollshard-store validate` on the dataset for every problem"
MAGIC = b"PAR1"  # a Parquet file's first 4 bytes (and last 4)


def open_shard(storage: Storage, shard: ShardInfo, footer: pq.FileMetaData | None = None) -> tuple[Any, pq.ParquetFile]:
    """``(file, ParquetFile)`` of a committed shard, after the cheap checks (the caller closes the file).

    ``footer``: the shard's footer as parsed before, used instead of reading it again (the loader passes it for a
    shard whose manifest records the footer's sha256, which its checks verify on the bytes)."""
    try:
        f = storage.fs.open_input_file(storage.path(shard.path))
    except FileNotFoundError:
        raise DataError(f"{shard.path}: the manifest lists this shard but the file is not there; {VALIDATE}") from None
    except OSError as e:
        raise DataError(f"{shard.path}: cannot open the shard: {one_line(e)}") from e
    try:
        size = f.size()
        try:
            pf = pq.ParquetFile(f, metadata=footer)
        except (OSError, pa.ArrowException) as e:
            if size != shard.bytes:  # the likelier cause of an unreadable footer: the file was cut or replaced
                raise _size_error(shard, size) from e
            raise DataError(f"{shard.path}: not readable as Parquet ({one_line(e)}); {VALIDATE}") from e
        check_schema_version(pf.schema_arrow.metadata, shard.path)
        if size != shard.bytes:
            raise _size_error(shard, size)
        check_row_groups(shard, pf.metadata)
    except BaseException:
        f.close()
        raise
    return f, pf


def check_row_groups(shard: ShardInfo, footer: pq.FileMetaData) -> None:
    """The manifest's row groups (when it lists them) are the footer's: as many, with as many rows each."""
    if shard.row_groups is None:
        return
    have = [footer.row_group(i).num_rows for i in range(footer.num_row_groups)]
    listed = [r.rows for r in shard.row_groups]
    if have != listed:
        raise DataError(
            f"{shard.path}: the manifest lists {len(listed)} row groups of {sum(listed)} rows, the file has "
            f"{len(have)} of {sum(have)}: the shard changed after it was committed; {VALIDATE}"
        )


def row_group_ranges(footer: pq.FileMetaData) -> list[tuple[int, int]] | None:
    """``[(offset, length)]`` of each row group's column chunks (from the first chunk's start, its dictionary page
    if any, to the last chunk's end); None unless the chunks are contiguous, row group after row group, from byte
    4 on (the magic before them, the footer after): then the magic, the ranges and the footer tile the file."""
    out, pos = [], len(MAGIC)
    for i in range(footer.num_row_groups):
        rg, start = footer.row_group(i), pos
        for c in range(rg.num_columns):
            col = rg.column(c)
            first = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
            if first != pos:
                return None
            pos = first + col.total_compressed_size
        out.append((start, pos - start))
    return out


def footer_start(shard: ShardInfo) -> int:
    """Where the footer starts (the end of the last row group), from the manifest's ranges."""
    rgs = shard.row_groups or ()
    return rgs[-1].offset + rgs[-1].length if rgs else len(MAGIC)


class FileDigests(NamedTuple):
    """One shard file's digests, as hex: the whole file's sha256; each row group range's and the footer's sha256; and,
    when asked for, their XXH3-128 (None otherwise)."""

    sha256: str
    ranges: list[str]  # [row group ranges]; empty without ranges
    footer: str
    ranges_xxh3: list[str] | None = None
    footer_xxh3: str | None = None


def file_digests(
    storage: Storage, rel: str, ranges: list[tuple[int, int]] | None, *, xxh3: bool = False
) -> FileDigests:
    """One sequential read of the file: its sha256, each range's (``ranges`` from :func:`row_group_ranges`; none
    when None), and the footer's (everything after the last range); with ``xxh3``, each range's and the footer's
    XXH3-128 too."""
    whole = hashlib.sha256()
    cuts = [(o, o + n) for o, n in ranges or []] + [(ranges[-1][0] + ranges[-1][1] if ranges else len(MAGIC), None)]
    parts = [[hashlib.sha256()] + ([xxhash.xxh3_128()] if xxh3 else []) for _ in cuts]
    pos = 0
    with storage.fs.open_input_stream(storage.path(rel)) as f:
        while (chunk := f.read_buffer(READ_CHUNK)).size:
            view = memoryview(chunk)
            whole.update(view)
            for (lo, hi), hashes in zip(cuts, parts):
                a, b = max(lo, pos), len(view) + pos if hi is None else min(hi, pos + len(view))
                if a < b:
                    for h in hashes:
                        h.update(view[a - pos : b - pos])
            pos += len(view)
    sha = [h[0].hexdigest() for h in parts]
    xx = [h[1].hexdigest() for h in parts] if xxh3 else None
    if ranges is None:
        return FileDigests(whole.hexdigest(), [], sha[-1], [] if xx else None, xx[-1] if xx else None)
    return FileDigests(whole.hexdigest(), sha[:-1], sha[-1], xx[:-1] if xx else None, xx[-1] if xx else None)


def verify_ranges(shard: ShardInfo, row_groups: tuple[int, ...], offset: int, data) -> None:
    """``data``, the bytes of the file from ``offset`` on, holds row groups ``row_groups`` (consecutive) whose
    manifest hash it must match (the XXH3-128 where recorded, else the sha256); raise :class:`DataError` naming
    the first that does not."""
    view = memoryview(data)
    for r in row_groups:
        info = shard.row_groups[r]
        name, expected, got = _digest(view[info.offset - offset : info.offset - offset + info.length], info.xxh3,
                                      info.sha256)
        if got != expected:
            raise DataError(
                f"{shard.path} (row group {r}, bytes {info.offset}-{info.offset + info.length}): {name} {got[:16]}... "
                f"differs from the manifest's {expected[:16]}...: the shard was damaged or changed after it was "
                f"committed; {VALIDATE}"
            )


def _digest(data, xxh3: str | None, sha256: str) -> tuple[str, str, str]:
    """``(hash name, the manifest's digest, the digest of data)``: XXH3-128 when the manifest records it, else
    sha256 (an older manifest)."""
    if xxh3 is not None:
        return "xxh3", xxh3, xxhash.xxh3_128(data).hexdigest()
    return "sha256", sha256, hashlib.sha256(data).hexdigest()


def verify_footer(
    storage: Storage, shard: ShardInfo, stop: threading.Event | None = None, parsed: pq.FileMetaData | None = None
) -> bool:
    """The magic at the start and the bytes after the last row group against the manifest's ``footer_xxh3``
    (``footer_sha256`` without it; two small ranged reads); raise :class:`DataError` when they differ.
    ``parsed``: the footer a reader decodes with (read when the dataset was opened), which must be the one those
    verified bytes hold."""
    start = footer_start(shard)
    try:
        with storage.fs.open_input_file(storage.path(shard.path)) as f:
            magic, tail = f.read_at(len(MAGIC), 0), f.read_at(shard.bytes - start, start)
    except OSError as e:
        raise DataError(f"{shard.path}: cannot read the shard to check its footer's sha256: {one_line(e)}") from e
    if magic != MAGIC:
        raise DataError(f"{shard.path}: does not start with the Parquet magic {MAGIC!r}: the shard was damaged or "
                        f"changed after it was committed; {VALIDATE}")
    name, expected, got = _digest(tail, shard.footer_xxh3, shard.footer_sha256)
    if got != expected:
        raise DataError(
            f"{shard.path} (footer, bytes {start}-{shard.bytes}): {name} {got[:16]}... differs from the manifest's "
            f"{expected[:16]}...: the shard was damaged or changed after it was committed; {VALIDATE}"
        )
    if parsed is not None and not pq.read_metadata(pa.BufferReader(tail)).equals(parsed):
        raise DataError(
            f"{shard.path} (footer): the footer read when the dataset was opened differs from the verified one on "
            f"disk: the shard changed or was misread since; open the dataset again, or {VALIDATE}"
        )
    return True


def verify_shard(storage: Storage, shard: ShardInfo) -> None:
    """A whole shard's bytes against its manifest entry, as the loader checks the blocks it reads: the size and
    footer (:func:`open_shard`), then each row group's range and the footer by their XXH3-128 (a version 4 manifest:
    one fast pass), else the file's sha256. For the commands that read every row of a dataset (stats, inspect,
    report, filter, rescore) before they use any; :class:`DataError` naming the shard (and row group) that
    differs."""
    f, pf = open_shard(storage, shard)
    f.close()
    ranged = shard.row_groups is not None and all(r.offset is not None and r.xxh3 for r in shard.row_groups)
    if not (ranged and shard.footer_xxh3):
        verify_sha256(storage, shard)
        return
    first = shard.row_groups[0].offset if shard.row_groups else footer_start(shard)
    try:
        with storage.fs.open_input_file(storage.path(shard.path)) as f:
            data = f.read_at(footer_start(shard) - first, first)
    except OSError as e:
        raise DataError(f"{shard.path}: cannot read the shard to check its bytes: {one_line(e)}") from e
    verify_ranges(shard, tuple(range(len(shard.row_groups))), first, data)
    verify_footer(storage, shard, parsed=pf.metadata)


def _size_error(shard: ShardInfo, size: int) -> DataError:
    return DataError(
        f"{shard.path}: {size} bytes on disk, the manifest says {shard.bytes}: the shard changed after it was "
        f"committed; {VALIDATE}"
    )


def check_column_types(schema: pa.Schema, columns: Iterable[str], where: str) -> None:
    """Every column in ``columns`` is in ``schema`` with exactly the type :data:`ROW_SCHEMA` declares.

    An optional column (:data:`~rollshard.store.format.schema.OPTIONAL_COLUMNS`, absent from shards of an older 1.x
    schema) may be absent; present, its type must be exact too. The sampling columns come as a pair.
    """
    columns = list(columns)
    if any(n in OPTIONAL_COLUMNS for n in columns):
        sampling_columns(schema, where)
    for name in columns:
        expected = ROW_SCHEMA.field(name).type
        i = schema.get_field_index(name)
        if i < 0 and name in ADDED_COLUMNS:
            continue
        if i < 0:
            raise DataError(
                f"{where}: lacks column {name!r} ({_type(expected)}) of rollshard schema v{SCHEMA_VERSION}; {VALIDATE}"
            )
        found = schema.field(i).type
        if _type(found) != _type(expected):  # value types only: a list's item name or nullability is no matter
            raise DataError(
                f"{where}: column {name!r} is {_type(found)}, expected {_type(expected)} "
                f"(rollshard schema v{SCHEMA_VERSION}); readers do not cast: rewrite the shard with rollshard's "
                "ShardWriter, which casts to the schema"
            )


def sampling_columns(schema: pa.Schema, where: str) -> list[str]:
    """The schema 1.1 sampling columns a shard has: both, or none (a 1.0 shard); one alone is a :class:`DataError`."""
    present = [n for n in OPTIONAL_COLUMNS if schema.get_field_index(n) >= 0]
    if len(present) == 1:
        missing = next(n for n in OPTIONAL_COLUMNS if n not in present)
        raise DataError(f"{where}: has column {present[0]!r} but not {missing!r}; a shard carries both sampling "
                        f"columns (schema 1.1) or neither (1.0); {VALIDATE}")
    return present


def _type(t: pa.DataType) -> str:
    """A type as a user reads it: list<int32>, not list<item: int32> or (from Parquet) list<element: int32>."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"{'large_' * pa.types.is_large_list(t)}list<{_type(t.value_type)}>"
    return str(t)


def check_rows(table: pa.Table, where: str, routing: RoutingShape | None = None) -> None:
    """Raise for the first row of ``table`` (a projection of the schema's columns) that breaks an invariant;
    ``routing``: the shard's routing shape (its config's), for a ``routed_experts`` column."""
    problems = check_projection(table, limit=1, routing=routing)  # the first is all the message shows
    if problems:
        p = problems[0]
        raise DataError(f"{where}: sample {p.sample_id!r}: {p.field}: {p.detail}; {VALIDATE}")


def verify_sha256(storage: Storage, shard: ShardInfo, stop: threading.Event | None = None) -> bool:
    """Hash the whole file; raise :class:`DataError` when it is not the manifest's. False: ``stop`` was set first."""
    h = hashlib.sha256()
    try:
        with storage.fs.open_input_stream(storage.path(shard.path)) as f:
            while (chunk := f.read_buffer(READ_CHUNK)).size:  # a pyarrow Buffer: hashed without a copy
                if stop is not None and stop.is_set():
                    return False
                h.update(memoryview(chunk))
    except OSError as e:
        raise DataError(f"{shard.path}: cannot read the shard to check its sha256: {one_line(e)}") from e
    if h.hexdigest() != shard.sha256:
        raise DataError(
            f"{shard.path}: sha256 {h.hexdigest()[:16]}... differs from the manifest's {shard.sha256[:16]}...: "
            f"the shard was damaged or changed after it was committed; {VALIDATE}"
        )
    return True


class Job:
    """One check for :class:`Checksums`: ``run(stop)`` raises :class:`DataError`, or returns False when ``stop``
    was set first (the job is then queued again by the next wait). ``done`` is set once it passed or failed."""

    def __init__(self, name: str, run):
        self.name, self._run = name, run
        self.done = threading.Event()
        self.error: DataError | None = None
        self.queued = False

    def run(self, stop: threading.Event) -> bool:
        try:
            if not self._run(stop):
                return False
        except DataError as e:
            self.error = e
        except BaseException as e:  # anything else must reach a waiter too, not leave it waiting forever
            self.error = DataError(f"{self.name}: checksum failed: {one_line(e)}")
        self._run = None  # what it held (a block's bytes) is no longer needed
        self.done.set()
        return True


class CheckThread:
    """The thread that runs :class:`Job` s in the order they are queued. It starts when a job is queued to an idle
    queue and ends when nothing is waiting; :meth:`close` stops it mid-check. Several :class:`Checksums` may share
    one (a mixture's sources: one checksum thread for all of them)."""

    def __init__(self, name: str):
        self.name = name
        self.lock = threading.Lock()
        self._todo: collections.deque[Job] = collections.deque()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def submit(self, job: Job) -> Job:
        """Queue ``job`` unless it is queued or done (starting the thread when it is idle)."""
        with self.lock:
            if job.done.is_set() or job.queued:
                return job
            job.queued = True
            self._todo.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(self._stop,), name=self.name, daemon=True)
                self._thread.start()
                _LIVE_CHECKS.add(self)
        return job

    def close(self) -> None:
        """Stop checking; checks not done yet are dropped (waited for again, they start from the beginning)."""
        if sys.is_finalizing():  # the interpreter is exiting: a daemon thread frozen holding the lock never lets go
            self._stop.set()
            return
        with self.lock:
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self.lock:
            for job in self._todo:
                job.queued = False
            self._todo.clear()
            self._stop = threading.Event()

    def _run(self, stop: threading.Event) -> None:
        while True:
            with self.lock:
                if stop.is_set() or not self._todo:
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                job = self._todo.popleft()
            if not job.run(stop):
                job.queued = False  # close() drops it; a later wait queues it again
                return


class Checksums:
    """Checks on one background thread (a :class:`CheckThread`, its own or shared), in the order they are queued: a
    shard's whole-file sha256 (:func:`verify_sha256`) or its footer's (:func:`verify_footer`), by shard
    (:meth:`touch`, :meth:`wait`), and any :class:`Job` (a block's bytes, :func:`verify_ranges`: :meth:`submit`,
    :meth:`wait_job`).

    The loader's reader queues a shard's check before it reads its blocks and each block's as it reads it, so
    hashing runs alongside reading and packing; the step planner waits for every check a step draws from before
    handing the step on. A shard's check runs once per loader (a later epoch does not repeat it; a shard rewritten
    in between is caught by its size, checked at every open, or not at all); a block's, once per read. The thread
    ends when nothing is waiting, and :meth:`close` stops it mid-check (every check queued on it, when shared).
    """

    POLL_S = 0.1  # how often a waiter checks whether it was told to stop

    def __init__(
        self,
        storage: Storage,
        shards: list[ShardInfo],
        thread: CheckThread,
        by_range: bool = False,
        footers: Callable[[int], pq.FileMetaData] | None = None,
    ):
        self._storage, self._shards = storage, shards
        self._by_range = by_range  # shards with byte ranges get their footer checked, not the whole file
        self._footers = footers  # shard -> the footer the reader decodes with, checked against the verified bytes
        self.thread = thread
        self._jobs: dict[int, Job] = {}  # the shards' checks

    def _shard_job(self, shard: int) -> Job:
        with self.thread.lock:
            job = self._jobs.get(shard)
            if job is None:
                info = self._shards[shard]
                if self._by_range and info.has_ranges:
                    parsed = self._footers(shard) if self._footers is not None else None
                    job = Job(info.path, lambda stop: verify_footer(self._storage, info, stop, parsed))
                else:  # verify_sha256 looked up at run time (tests replace it)
                    job = Job(info.path, lambda stop: verify_sha256(self._storage, info, stop))
                job = self._jobs.setdefault(shard, job)
            return job

    def touch(self, shard: int) -> threading.Event:
        """Queue ``shard``'s check unless it is queued or done; returns the event set once it passed or failed."""
        job = self.submit(self._shard_job(shard))
        return job.done

    def submit(self, job: Job) -> Job:
        """Queue ``job`` unless it is queued or done (starting the thread when it is idle)."""
        return self.thread.submit(job)

    def wait(self, shard: int, stop: threading.Event | None = None) -> bool:
        """Block until ``shard``'s check passed; raise its :class:`DataError`; False when ``stop`` is set first."""
        return self.wait_job(self._shard_job(shard), stop)

    def wait_job(self, job: Job, stop: threading.Event | None = None) -> bool:
        """Block until ``job`` passed; raise its :class:`DataError`; False when ``stop`` is set first."""
        while not self.submit(job).done.wait(self.POLL_S):  # submitted again if close() dropped it meanwhile
            if stop is not None and stop.is_set():
                return False
        if job.error is not None:
            raise job.error
        return True

    def close(self) -> None:
        """Stop checking; checks not done yet are dropped (waited for again, they start from the beginning)."""
        self.thread.close()


_LIVE_CHECKS: "weakref.WeakSet[CheckThread]" = weakref.WeakSet()


@atexit.register
def _stop_checks() -> None:
    """Stop every checksum thread before the interpreter finalizes: one still reading through Arrow when
    libarrow is torn down aborts the process (as store/loader/background.py's threads would)."""
    for checks in list(_LIVE_CHECKS):
        checks._stop.set()
        thread = checks._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)

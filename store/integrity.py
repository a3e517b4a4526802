"""Checks that a shard is the file its manifest entry committed, before any of its rows is used.

Readers (the loader, :class:`rollshard.store.dataset.RolloutDataset`) call these; each
raises :class:`rollshard.store.errors.DataError` with one line naming the shard (its path
relative to the dataset), the row (sample id) where there is one, and the problem.

* :func:`open_shard`: the file is there, its footer reads, its schema major is one this
  rollshard reads, its size is the manifest's, and so are its row groups' row counts when the
  manifest lists them (:func:`check_row_groups`). Cheap (one footer read).
* :func:`check_column_types`: the columns a reader uses have exactly the schema's types.
  A reader that cast would turn int64 ids or float64 logprobs into the schema's types
  silently; a file that does not match was not written by rollshard's writer, whose
  other promises then do not hold either. The schema 1.1 sampling columns may be absent
  (a 1.0 shard), both together.
* :func:`check_rows`: the row invariants of :func:`rollshard.store.schema.check_projection`
  on the block of columns just read.
* :func:`verify_sha256`: the file's sha256 against the manifest's. It reads the whole
  file, so the loader runs it on a background thread (:class:`Checksums`) and holds back
  every step drawn from a shard until that shard is verified.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from rollshard.store.errors import DataError
from rollshard.store.manifest import ShardInfo
from rollshard.store.schema import OPTIONAL_COLUMNS, ROW_SCHEMA, SCHEMA_VERSION, check_projection, check_schema_version
from rollshard.store.storage import Storage

__all__ = ["Checksums", "DataError", "check_column_types", "check_rows", "open_shard", "sampling_columns", "verify_sha256"]

READ_CHUNK = 8 << 20  # bytes hashed per read: large enough that hashlib releases the GIL and reads stream
VALIDATE = "run `rollshard-store validate` on the dataset for every problem"


def open_shard(storage: Storage, shard: ShardInfo) -> tuple[Any, pq.ParquetFile]:
    """``(file, ParquetFile)`` of a committed shard, after the cheap checks (the caller closes the file)."""
    try:
        f = storage.fs.open_input_file(storage.path(shard.path))
    except FileNotFoundError:
        raise DataError(f"{shard.path}: the manifest lists this shard but the file is not there; {VALIDATE}") from None
    except OSError as e:
        raise DataError(f"{shard.path}: cannot open the shard: {_one_line(e)}") from e
    try:
        size = f.size()
        try:
            pf = pq.ParquetFile(f)
        except (OSError, pa.ArrowException) as e:
            if size != shard.bytes:  # the likelier cause of an unreadable footer: the file was cut or replaced
                raise _size_error(shard, size) from e
            raise DataError(f"{shard.path}: not readable as Parquet ({_one_line(e)}); {VALIDATE}") from e
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


def _size_error(shard: ShardInfo, size: int) -> DataError:
    return DataError(
        f"{shard.path}: {size} bytes on disk, the manifest says {shard.bytes}: the shard changed after it was "
        f"committed; {VALIDATE}"
    )


def check_column_types(schema: pa.Schema, columns: Iterable[str], where: str) -> None:
    """Every column in ``columns`` is in ``schema`` with exactly the type :data:`ROW_SCHEMA` declares.

    An optional column (:data:`~rollshard.store.schema.OPTIONAL_COLUMNS`, absent from shards of an older 1.x
    schema) may be absent; present, its type must be exact too. The sampling columns come as a pair.
    """
    columns = list(columns)
    if any(n in OPTIONAL_COLUMNS for n in columns):
        sampling_columns(schema, where)
    for name in columns:
        expected = ROW_SCHEMA.field(name).type
        i = schema.get_field_index(name)
        if i < 0 and name in OPTIONAL_COLUMNS:
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


def check_rows(table: pa.Table, where: str) -> None:
    """Raise for the first row of ``table`` (a projection of the schema's columns) that breaks an invariant."""
    problems = check_projection(table, limit=1)  # the first is all the message shows; the rest cost detail work
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
        raise DataError(f"{shard.path}: cannot read the shard to check its sha256: {_one_line(e)}") from e
    if h.hexdigest() != shard.sha256:
        raise DataError(
            f"{shard.path}: sha256 {h.hexdigest()[:16]}... differs from the manifest's {shard.sha256[:16]}...: "
            f"the shard was damaged or changed after it was committed; {VALIDATE}"
        )
    return True


class Checksums:
    """:func:`verify_sha256` of a dataset's shards on one background thread, in the order they are touched.

    The loader's reader touches a shard when it first reads a block of it, so hashing runs
    alongside reading and packing; the step planner waits for every shard a step draws
    from before handing the step on. Each shard is verified once per loader: a later epoch
    reads verified shards without hashing them again (a shard rewritten in between is
    caught by its size, checked at every open, or not at all). The thread ends when no
    shard is waiting, and :meth:`close` stops it mid-file.
    """

    POLL_S = 0.1  # how often a waiter checks whether it was told to stop

    def __init__(self, storage: Storage, shards: list[ShardInfo], name: str):
        self._storage, self._shards, self._name = storage, shards, name
        self._lock = threading.Lock()
        self._done: dict[int, threading.Event] = {}  # touched shards; set once verified (or refused)
        self._errors: dict[int, DataError] = {}
        self._todo: collections.deque[int] = collections.deque()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def touch(self, shard: int) -> threading.Event:
        """Queue ``shard`` for hashing unless it is queued or done (starting the thread when it is idle);
        returns the event set once it is verified or refused."""
        with self._lock:
            done = self._done.get(shard)
            if done is not None:
                return done
            done = self._done[shard] = threading.Event()
            self._todo.append(shard)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(self._stop,), name=self._name, daemon=True)
                self._thread.start()
            return done

    def wait(self, shard: int, stop: threading.Event | None = None) -> bool:
        """Block until ``shard`` is verified; raise its :class:`DataError`; False when ``stop`` is set first."""
        done = self.touch(shard)
        while not done.wait(self.POLL_S):
            if stop is not None and stop.is_set():
                return False
            done = self.touch(shard)  # the same event, unless close() forgot the shard meanwhile
        error = self._errors.get(shard)
        if error is not None:
            raise error
        return True

    def close(self) -> None:
        """Stop hashing; shards not verified yet are forgotten (touched again, they are hashed from the start)."""
        with self._lock:
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            self._todo.clear()
            for shard in [s for s, done in self._done.items() if not done.is_set()]:
                del self._done[shard]
            self._stop = threading.Event()

    def _run(self, stop: threading.Event) -> None:
        while True:
            with self._lock:
                if stop.is_set() or not self._todo:
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                shard = self._todo.popleft()
                done = self._done[shard]
            try:
                if not verify_sha256(self._storage, self._shards[shard], stop):
                    return  # close() forgets the shard
            except DataError as e:
                self._errors[shard] = e
            except BaseException as e:  # anything else must reach a waiter too, not leave it waiting forever
                self._errors[shard] = DataError(f"{self._shards[shard].path}: checksum failed: {_one_line(e)}")
            done.set()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())

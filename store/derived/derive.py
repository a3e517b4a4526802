"""Derive a dataset from another, shard by shard: the primitive under ``filter`` and ``rescore``.

:func:`derive_dataset` reads the parent one row group at a time (memory stays bounded by a
row group), hands each to ``transform(table) -> table`` and writes what comes back into a
new dataset ``out``, one output shard per parent shard, through
:class:`~rollshard.store.io.writer.ShardWriter` (row invariants checked, commits atomic).

The rules, exactly:

* ``transform`` gets one parent row group at a time, cast to
  :data:`~rollshard.store.format.schema.ROW_SCHEMA` (no footer metadata), and returns a table of
  the schema's columns (others are dropped, types cast). It may drop rows and may change
  the columns in ``mutable_columns`` (``()`` for a filter; ``("reward", "metadata")`` for a
  rescore). It may not add rows, repeat one or change any other column: for every row it
  returns (matched to the parent by ``sample_id``) every other column must be
  byte-identical to the parent's (floats compared bit for bit, so 0.0 -> -0.0 is a change),
  else :class:`TransformError` names the shard, the sample and the column. ``sample_id`` is
  never mutable. Returning the table it was given (or an equal one) means "unchanged".
* Each row group of the parent becomes at most one row group of the output, so a GRPO
  group (whole in one row group, as the writer flushes whole groups) stays whole in one
  shard; a row filter may still leave part of a group.
* A parent shard whose every row group comes back unchanged (same rows, same order, same
  values) is copied byte for byte: same sha256, no re-encode. One with no row left
  produces no shard. Any other is rewritten. Either way the parent shard's sha256 is
  checked against its manifest before the output is committed (a copy as it is copied), so
  a damaged shard is not carried over (:class:`~rollshard.store.common.DataError`).
* The output has one writer per parent writer, ``<writer_id>.<parent writer id>`` (the
  parent id hashed when that passes 128 characters), whose config is the parent writer's
  plus the lineage (:mod:`rollshard.store.format.lineage`); a copied shard keeps its parent's footer.
* Resume: progress is kept in ``out/_derive/state.json`` (written atomically): the
  derivation's identity, and for each parent shard done, its output shard. The parent
  shard in flight is recorded before its output is committed, so after a kill at any
  point a rerun of the same derivation into the same ``out`` attributes a committed
  output to it or redoes it, never both: no row is lost or duplicated. Locally a lock on
  ``out/_derive/lock`` refuses a second derive into the same ``out`` meanwhile.
* Refused with :class:`DeriveError` (one line): ``out`` equal to or inside the parent;
  ``out`` existing and not a derive; a rerun whose parent, operation, details or mutable
  columns differ from the derive ``out`` holds; a parent that changed (fingerprint) since
  that derive began; a parent that is itself a derive that has not finished.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Collection

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.common import DataError, utc_now
from rollshard.store.common import progress as progress_bar
from rollshard.store.io.integrity import check_column_types, open_shard, verify_sha256
from rollshard.store.format.lineage import derived_config, identity, lineage_entry
from rollshard.store.format.manifest import SHARD_DIR, WRITER_ID_RE, Manifest, ShardInfo, fingerprint, load_manifests
from rollshard.store.format.schema import ROW_SCHEMA, cast_table
from rollshard.store.io.storage import PendingFile, Storage
from rollshard.store.io.writer import ShardWriter, WriterOptions

STATE_DIR = "_derive"  # underscore: readers skip it
STATE_FILE = f"{STATE_DIR}/state.json"
STATE_FORMAT = "rollshard-derive"
STATE_VERSION = 1
COPY_CHUNK = 8 << 20  # bytes per read when a shard is copied
# The writer commits and flushes only when told: one output shard per parent shard, one row group per row group.
NEVER = 1 << 62
WRITER_OPTIONS = WriterOptions(row_group_bytes=NEVER, shard_bytes=NEVER)
MAX_WRITER_ID = 100  # leaves room for ".<parent writer id>" within the manifest's 128 characters

Transform = Callable[[pa.Table], pa.Table]
FLOAT_COLUMNS = frozenset(
    f.name
    for f in ROW_SCHEMA
    if pa.types.is_floating(f.type) or (pa.types.is_list(f.type) and pa.types.is_floating(f.type.value_type))
)


class DeriveError(ValueError):
    """A derive refused before it touched anything: the out location, the parent, or a mismatched rerun."""


class TransformError(ValueError):
    """The transform broke the derive's contract: it changed a column it may not, or added a row."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class DeriveResult:
    """Totals over the whole derivation (shards done by an earlier, interrupted run included)."""

    out: str
    operation: str
    mutable_columns: tuple[str, ...]
    parent_fingerprint: str
    fingerprint: str  # of the derived dataset
    rows_in: int
    rows_out: int
    rows_changed: int  # rows kept with a mutable column changed
    shards_copied: int
    shards_rewritten: int
    shards_dropped: int
    shards_resumed: int  # of the above, done by an earlier run

    @property
    def rows_dropped(self) -> int:
        return self.rows_in - self.rows_out

    def summary(self) -> str:
        """One line: ``kept 5 of 8 rows (3 dropped); shards: 1 copied, 1 rewritten, 0 dropped``; the rows
        changed are counted when the operation may change a column (``3 dropped, 4 changed``)."""
        changed = f", {self.rows_changed:,} changed" if self.mutable_columns else ""
        resumed = f" ({self.shards_resumed} done by an earlier run)" if self.shards_resumed else ""
        return (
            f"kept {self.rows_out:,} of {self.rows_in:,} rows ({self.rows_dropped:,} dropped{changed}); shards: "
            f"{self.shards_copied} copied, {self.shards_rewritten} rewritten, {self.shards_dropped} dropped{resumed}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "rows_dropped": self.rows_dropped}


def derive_dataset(
    parent: str | os.PathLike | RolloutDataset,
    out: str | os.PathLike,
    transform: Transform,
    *,
    operation: str,
    details: dict[str, Any],
    mutable_columns: Collection[str] = (),
    command: str | None = None,
    writer_id: str | None = None,
    progress: bool = True,
) -> DeriveResult:
    """Write ``transform`` of every row group of ``parent`` into the new dataset ``out`` (module docstring).

    ``operation`` and ``details`` (plain JSON) are recorded in the lineage and identify the
    derivation for resume; ``command`` is recorded as is (default: ``operation``);
    ``writer_id`` (default: ``operation``) prefixes the output writers. ``progress`` shows
    a bar on stderr when it is a terminal. Raises :class:`DeriveError`, :class:`TransformError`,
    :class:`~rollshard.store.format.schema.RowInvariantError` (a transformed row breaks an invariant)
    and :class:`~rollshard.store.common.DataError` (a damaged parent shard).
    """
    ds = parent if isinstance(parent, RolloutDataset) else RolloutDataset.open(parent)
    mutable = _check_mutable(mutable_columns)
    writer_id = writer_id or operation
    if not (WRITER_ID_RE.match(writer_id) and len(writer_id) <= MAX_WRITER_ID):
        raise ValueError(
            f"writer id {writer_id!r} must be 1-{MAX_WRITER_ID} characters of letters, digits, '_', '.', '-'"
        )
    _refuse_unfinished_parent(ds.storage)
    try:  # a damaged parent is said before anything is written (nothing half-written is left behind)
        ds.verify()
    except DataError as e:
        raise DeriveError(f"{ds.storage.uri}: {e}") from e
    out_storage = Storage(out)
    _refuse_out_in_parent(ds.storage, out_storage)
    entry = lineage_entry(
        operation=operation,
        parent=_location(ds.storage),
        parent_fingerprint=ds.fingerprint,
        details=details,
        mutable_columns=mutable,
        command=command or operation,
    )
    state = DeriveState.open(out_storage, entry, ds, writer_id)
    hide = None if progress else True  # tqdm's disable: None hides the bar only when stderr is not a terminal
    bar_options = dict(desc=operation, unit="rows", disable=hide, leave=False)  # leave=False: cleared when done
    with DeriveLock(out_storage), progress_bar(ds.num_rows, **bar_options) as bar:
        for manifest in ds.manifests:
            out_wid = state.writer_for(manifest, writer_id)
            config = state.configs[out_wid]
            with ShardWriter(out_storage, writer_id=out_wid, config=config, options=WRITER_OPTIONS) as w:
                state.reconcile(w)
                for shard in sorted(manifest.shards, key=lambda s: s.path):
                    if shard.path in state.done:
                        state.resumed += 1
                        bar.update(shard.rows)
                        continue
                    _derive_shard(ds, shard, w, transform, mutable, state, bar)
        state.finish()
    return state.result(out_storage, ds.fingerprint)


# -- one shard ------------------------------------------------------------------------------


def _derive_shard(
    ds: RolloutDataset, shard: ShardInfo, w: ShardWriter, transform: Transform, mutable: frozenset[str], state, bar
) -> None:
    operation = state.entry["operation"]
    f, pf = open_shard(ds.storage, shard)
    with f:
        check_column_types(pf.schema_arrow, ROW_SCHEMA.names, shard.path)
        rows_out = changed = 0
        rewriting = False
        for i in range(pf.num_row_groups):
            old = cast_table(_read_row_group(ds.storage, shard, pf, i))
            new, n_changed, same = _compare(old, transform(old), mutable, shard.path, operation)
            rows_out, changed = rows_out + new.num_rows, changed + n_changed
            if not same and not rewriting:  # the row groups before were unchanged: they go in as they are
                rewriting = True
                for j in range(i):
                    w.write_groups(_read_row_group(ds.storage, shard, pf, j))
                    w.flush()
            if rewriting:
                w.write_groups(new)
                w.flush()
            bar.update(old.num_rows)
    record = {"parent": shard.path, "writer": w.writer_id, "rows_in": shard.rows, "rows_out": rows_out,
              "rows_changed": changed}
    if not rewriting:
        state.begin({**record, "action": "copied"})
        info = _copy_shard(ds.storage, shard, w)
    elif rows_out == 0:
        state.begin({**record, "action": "dropped"})
        info = None
    else:
        verify_sha256(ds.storage, shard)  # the rows just read were the committed shard's
        state.begin({**record, "action": "rewritten"})
        info = w.commit()
    state.end(info.path if info else None)


def _read_row_group(storage: Storage, shard: ShardInfo, pf, i: int) -> pa.Table:
    """Row group ``i``; a shard that does not decode is a :class:`DataError` (a sha256 mismatch, when it is one)."""
    try:
        return pf.read_row_group(i)
    except (OSError, pa.ArrowException) as e:
        verify_sha256(storage, shard)
        raise DataError(f"{shard.path}: row group {i} does not read ({' '.join(str(e).split())}); run "
                        "`rollshard-store validate` on the parent") from e


def _copy_shard(storage: Storage, shard: ShardInfo, w: ShardWriter) -> ShardInfo:
    """Copy a parent shard byte for byte into ``w``'s dataset and manifest, named as the writer names its own
    shards, so that a copy renamed but not yet in the manifest is adopted by the writer when it is reopened."""
    rel = f"{SHARD_DIR}/{w.writer_id}-{_next_seq(w.manifest):05d}.parquet"
    pending = PendingFile(w.storage, rel)
    h = hashlib.sha256()
    try:
        with storage.fs.open_input_stream(storage.path(shard.path)) as src:
            while (chunk := src.read(COPY_CHUNK)):
                h.update(chunk)
                pending.file.write(chunk)
        if h.hexdigest() != shard.sha256:
            raise DataError(
                f"{shard.path}: sha256 {h.hexdigest()[:16]}... differs from the manifest's {shard.sha256[:16]}...: the "
                "shard was damaged or changed after it was committed; run `rollshard-store validate` on the parent"
            )
        sha, size = pending.commit()
    except BaseException:
        pending.discard()
        raise
    info = dataclasses.replace(shard, path=rel, bytes=size, sha256=sha, writer_id=w.writer_id, created_at=utc_now())
    w.manifest.shards.append(info)
    w.save_manifest()
    return info


def _next_seq(manifest: Manifest) -> int:
    """The writer's rule for its next shard number (writer.ShardWriter._next_seq)."""
    seqs = [int(s.path.rsplit("-", 1)[1].split(".")[0]) for s in manifest.shards]
    return max(seqs, default=-1) + 1


# -- the contract check ---------------------------------------------------------------------


def _compare(
    old: pa.Table, new: Any, mutable: frozenset[str], where: str, operation: str
) -> tuple[pa.Table, int, bool]:
    """``(new cast to the schema, rows with a mutable column changed, new is old unchanged)``; raises
    :class:`TransformError` where ``new`` breaks the rules of the module docstring."""
    if not isinstance(new, pa.Table):
        raise TransformError(f"the {operation} transform returned {type(new).__name__}, not a pyarrow Table")
    try:
        new = cast_table(new)
    except ValueError as e:
        raise TransformError(
            f"{where}: the {operation} transform returned a table that is not a rollout table: {e}"
        ) from e
    old_ids, new_ids = old.column("sample_id"), new.column("sample_id")
    aligned = new.num_rows == old.num_rows and new_ids.equals(old_ids)
    if not aligned:
        if new.num_rows and len(pc.unique(new_ids)) != new.num_rows:
            dup = _first_duplicate(new_ids.to_pylist())
            raise TransformError(f"{where}: the {operation} transform returned sample {dup!r} twice; a derive keeps "
                                 "or drops each row, it never repeats one")
        index = pc.index_in(new_ids, value_set=old_ids)
        if index.null_count:
            sid = new_ids[int(np.flatnonzero(index.is_null().to_numpy(zero_copy_only=False))[0])].as_py()
            raise TransformError(
                f"{where}: the {operation} transform returned sample {sid!r}, which is not in this row group of "
                "the parent; a derive keeps or drops rows, it never adds one"
            )
        old = old.take(index)
    changed = np.zeros(new.num_rows, bool)
    for name in ROW_SCHEMA.names:
        a, b = old.column(name), new.column(name)
        if name not in FLOAT_COLUMNS and a.equals(b):  # Arrow's equals holds -0.0 == 0.0: floats go bit by bit
            continue
        diff = _row_diff(a, b)
        if name in mutable:
            changed |= diff
        elif diff.any():
            sid = new_ids[int(np.flatnonzero(diff)[0])].as_py()
            may = ", ".join(sorted(mutable)) or "no column"
            raise TransformError(
                f"{where}: sample {sid!r}: the {operation} transform changed {name}, which must stay byte-identical to "
                f"the parent's ({operation} may change: {may}); fix the transform"
            )
    return new, int(changed.sum()), aligned and not changed.any()


def _row_diff(a: pa.ChunkedArray, b: pa.ChunkedArray) -> np.ndarray:
    """``[rows]`` True where the values of two columns of one type differ, bit for bit (NaN equals NaN)."""
    a, b = a.combine_chunks(), b.combine_chunks()
    null_a = a.is_null().to_numpy(zero_copy_only=False)
    diff = null_a != b.is_null().to_numpy(zero_copy_only=False)
    t = a.type
    if pa.types.is_list(t) and _fixed_width(t.value_type):
        len_a = pc.fill_null(pc.list_value_length(a), -1).to_numpy(zero_copy_only=False)
        len_b = pc.fill_null(pc.list_value_length(b), -1).to_numpy(zero_copy_only=False)
        diff |= len_a != len_b
        same_len = np.flatnonzero(~diff & ~null_a)
        if same_len.size:
            if same_len.size == len(a):  # the common case: no copy
                fa, fb = pc.list_flatten(a), pc.list_flatten(b)
            else:
                idx = pa.array(same_len)
                fa, fb = pc.list_flatten(a.take(idx)), pc.list_flatten(b.take(idx))  # aligned: equal lengths
            bad = np.flatnonzero(_value_diff(fa, fb))
            if bad.size:
                ends = np.cumsum(len_a[same_len])
                diff[same_len[np.unique(np.searchsorted(ends, bad, side="right"))]] = True
        return diff
    if _fixed_width(t):
        return diff | (~null_a & _value_diff(a, b))
    both = ~diff & ~null_a
    va, vb = a.to_pylist(), b.to_pylist()  # strings and structs: exact by value
    return diff | np.array([bool(both[i]) and va[i] != vb[i] for i in range(len(va))], bool)


def _value_diff(a: pa.Array, b: pa.Array) -> np.ndarray:
    """``[n]`` bits differ, for two fixed-width arrays of equal length (values under a null in both: equal)."""
    valid = ~(a.is_null().to_numpy(zero_copy_only=False) | b.is_null().to_numpy(zero_copy_only=False))
    return valid & (_bits(a) != _bits(b))


def _bits(arr: pa.Array) -> np.ndarray:
    width = arr.type.bit_width // 8
    raw = np.frombuffer(arr.buffers()[1], dtype=np.dtype(f"u{width}"), count=arr.offset + len(arr))
    return raw[arr.offset:]


def _fixed_width(t: pa.DataType) -> bool:
    return (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_timestamp(t)) and t.bit_width >= 8


def _first_duplicate(ids: list[str]) -> str:
    seen: set[str] = set()
    for s in ids:
        if s in seen:
            return s
        seen.add(s)
    raise AssertionError("no duplicate")


def _check_mutable(columns: Collection[str]) -> frozenset[str]:
    if isinstance(columns, str):
        raise ValueError(f"mutable_columns takes a collection of column names, not the string {columns!r}")
    unknown = sorted(set(columns) - set(ROW_SCHEMA.names))
    if unknown:
        raise ValueError(f"mutable_columns {unknown} are not columns of the row schema ({', '.join(ROW_SCHEMA.names)})")
    if "sample_id" in columns:
        raise ValueError("sample_id cannot be a mutable column: a derive matches each row to its parent row by it")
    return frozenset(columns)


# -- where, and the resume state ------------------------------------------------------------


def _location(storage: Storage) -> str:
    """A dataset's location as lineage records it: the absolute path of a local one, else the URI as given."""
    return storage.root if storage.local else storage.uri


def _refuse_out_in_parent(parent: Storage, out: Storage) -> None:
    if parent.fs.type_name != out.fs.type_name:
        return
    p, o = Path(parent.root), Path(out.root)
    if o == p or p in o.parents:
        raise DeriveError(f"out {out.uri} is {'the parent' if o == p else 'inside the parent'} {parent.uri}; "
                          "derive into a new directory outside it")


def _refuse_unfinished_parent(parent: Storage) -> None:
    if parent.exists(STATE_FILE):
        doc = _read_state(parent)
        if not doc.get("complete"):
            raise DeriveError(f"parent {parent.uri} is a {doc['derived']['operation']} derive that did not finish; "
                              "rerun that derive to completion first")


def _read_state(storage: Storage) -> dict[str, Any]:
    try:
        doc = json.loads(storage.read_bytes(STATE_FILE))
        if doc.get("format") != STATE_FORMAT or not isinstance(doc.get("derived"), dict):
            raise ValueError(f"format is {doc.get('format')!r}, expected {STATE_FORMAT!r}")
        if int(doc.get("version", 0)) > STATE_VERSION:
            raise ValueError(
                f"version {doc['version']} is newer than this rollshard's {STATE_VERSION}; upgrade rollshard"
            )
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise DeriveError(f"{storage.path(STATE_FILE)}: unreadable derive state ({e}); derive into a new out") from e
    return doc


class DeriveState:
    """``out/_derive/state.json``: what a rerun must match, and which parent shards are done (module docstring)."""

    def __init__(self, storage: Storage, doc: dict[str, Any]):
        self.storage, self.doc = storage, doc
        self.resumed = 0  # parent shards found done by an earlier run

    @property
    def entry(self) -> dict[str, Any]:
        return self.doc["derived"]

    @property
    def configs(self) -> dict[str, dict[str, Any]]:
        return self.doc["configs"]

    @property
    def done(self) -> dict[str, dict[str, Any]]:
        return self.doc["done"]

    @classmethod
    def open(cls, out: Storage, entry: dict[str, Any], parent: RolloutDataset, writer_id: str) -> "DeriveState":
        info = out.fs.get_file_info(out.root)
        if info.type == pafs.FileType.File:
            raise DeriveError(f"out {out.uri} is a file; give a new directory")
        if out.exists(STATE_FILE):
            state = cls(out, _read_state(out))
            state._check_rerun(entry, parent)
            return state
        if info.type == pafs.FileType.Directory:
            sel = pafs.FileSelector(out.root, allow_not_found=True)
            others = sorted(i.base_name for i in out.fs.get_file_info(sel) if i.base_name != STATE_DIR)
            if others:
                raise DeriveError(f"out {out.uri} exists and is not a derive (it holds {', '.join(others[:3])}); "
                                  "give a new or empty directory")
        doc = {"format": STATE_FORMAT, "version": STATE_VERSION, "derived": entry, "writers": {}, "configs": {},
               "done": {}, "current": None, "complete": False}
        state = cls(out, doc)
        for m in parent.manifests:
            state.writer_for(m, writer_id)
        state.save()
        return state

    def _check_rerun(self, entry: dict[str, Any], parent: RolloutDataset) -> None:
        old, new = identity(self.entry), identity(entry)
        where = self.storage.uri
        if old["parent"] != new["parent"]:
            raise DeriveError(f"out {where} was derived from {old['parent']}, not {new['parent']}; give a new out")
        if old["parent_fingerprint"] != new["parent_fingerprint"]:
            raise DeriveError(
                f"parent {new['parent']} changed since the derive into {where} began (fingerprint "
                f"{old['parent_fingerprint']} then, {new['parent_fingerprint']} now); derive into a new out"
            )
        for key in ("operation", "details", "mutable_columns"):
            if old[key] != new[key]:
                raise DeriveError(
                    f"out {where} holds a {old['operation']} derive with other {key} "
                    f"({json.dumps(old[key], sort_keys=True)} there, {json.dumps(new[key], sort_keys=True)} now); "
                    "rerun it with the same settings to resume, or give a new out"
                )

    def writer_for(self, manifest: Manifest, writer_id: str) -> str:
        """The output writer of a parent writer, its config recorded on first use."""
        writers = self.doc["writers"]
        if manifest.writer_id not in writers:
            out_wid = f"{writer_id}.{manifest.writer_id}"
            if len(out_wid) > 128:
                out_wid = f"{writer_id}.{hashlib.sha256(manifest.writer_id.encode()).hexdigest()[:16]}"
            writers[manifest.writer_id] = out_wid
            self.configs[out_wid] = derived_config(manifest.config or {}, self.entry, parent_writer=manifest.writer_id)
        return writers[manifest.writer_id]

    def reconcile(self, w: ShardWriter) -> None:
        """After a kill between an output's commit and :meth:`end`: the shard ``w`` holds that no done record
        names is the output of the parent shard in flight."""
        current = self.doc["current"]
        if current is None or current["writer"] != w.writer_id:
            return
        named = {r["output"] for r in self.done.values()}
        unnamed = [s.path for s in w.committed_shards if s.path not in named]
        assert len(unnamed) <= 1, f"{w.writer_id}: more than one output shard without a parent: {unnamed}"
        if unnamed:
            self.end(unnamed[0])
        else:
            self.doc["current"] = None
            self.save()

    def begin(self, record: dict[str, Any]) -> None:
        self.doc["current"] = record
        self.save()

    def end(self, output: str | None) -> None:
        record = self.doc["current"]
        self.done[record["parent"]] = {**record, "output": output}
        self.doc["current"] = None
        self.save()

    def finish(self) -> None:
        self.doc["complete"] = True
        self.save()

    def save(self) -> None:
        self.storage.makedirs(STATE_DIR)
        self.storage.write_atomic(STATE_FILE, json.dumps(self.doc, indent=1, sort_keys=True).encode())

    def result(self, out: Storage, parent_fingerprint: str) -> DeriveResult:
        records = list(self.done.values())
        actions = [r["action"] for r in records]
        return DeriveResult(
            out=out.uri,
            operation=self.entry["operation"],
            mutable_columns=tuple(self.entry["mutable_columns"]),
            parent_fingerprint=parent_fingerprint,
            fingerprint=fingerprint([s for m in load_manifests(out) for s in m.shards]),
            rows_in=sum(r["rows_in"] for r in records),
            rows_out=sum(r["rows_out"] for r in records),
            rows_changed=sum(r["rows_changed"] for r in records),
            shards_copied=actions.count("copied"),
            shards_rewritten=actions.count("rewritten"),
            shards_dropped=actions.count("dropped"),
            shards_resumed=self.resumed,
        )


class DeriveLock:
    """An exclusive lock on ``out/_derive/lock``: two derives into one out refuse to mix (on S3 a lease,
    store/io/s3.py, held as a writer id is)."""

    def __init__(self, storage: Storage):
        self.storage, self.fd, self.lease = storage, None, None

    def __enter__(self) -> "DeriveLock":
        if self.storage.s3:
            from rollshard.store.io.s3 import Lease, S3Error

            self.storage.bucket.check_conditional_writes(self.storage.root)
            lease = Lease(self.storage.bucket, self.storage.path(f"{STATE_DIR}/lock.lease"), uri=self.storage.uri,
                          writer_id="derive")
            try:
                lease.acquire()
            except S3Error as e:
                raise DeriveError(f"another process is deriving into {self.storage.uri}; wait for it to finish "
                                  f"({e})") from e
            self.lease = lease
        elif self.storage.local:
            self.storage.makedirs(STATE_DIR)
            self.fd = os.open(self.storage.path(f"{STATE_DIR}/lock"), os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                os.close(self.fd)
                raise DeriveError(f"another process is deriving into {self.storage.uri}; wait for it to finish") from e
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)
        if self.lease is not None:
            self.lease.release()

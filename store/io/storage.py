"""Where a dataset lives: a local directory, ``s3://bucket/prefix``, or any other pyarrow filesystem.

The commit protocol needs: write a file so that it appears whole or not at all, list files, read
them, and one process at a time per writer id. What each kind of store guarantees:

* **Local** (and a POSIX file system shared by hosts): write-temp, fsync, rename (plus an fsync of
  the directory so the rename survives a power cut); a writer id is held with ``flock`` on
  ``_manifests/<writer_id>.lock`` (on NFS only as far as its server honours locks).
* **S3** (store/io/s3.py): shards uploaded in parts and completed with ``If-None-Match`` (created once,
  visible whole on commit, an aborted upload never visible), manifests rewritten with ``If-Match`` on
  the ETag their writer last wrote, a writer id held by a lease object.
* **Other pyarrow filesystems** (GCS, HDFS, Azure): shards written under ``_tmp/`` and moved into
  place on commit, so an aborted or crashed upload is never adopted; nothing stops two processes
  from writing as one writer id: give each its own.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import queue
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow.fs as pafs

from rollshard.store.common import fsync_dir, write_atomic

TMP_DIR = "_tmp"  # underscore: pyarrow.dataset and most readers skip it


class HashingFile(io.RawIOBase):
    """A write-only file that feeds every byte to sha256 on its way to ``sink``.

    Hashing while writing saves re-reading a shard to checksum it. The hash and the
    write run on a background thread (hashlib and file writes release the GIL), so they
    overlap with Parquet encoding instead of adding to it; at most ``max_pending``
    buffers wait in between.

    The hand-off survives an exception raised into the writing thread at any point (a
    KeyboardInterrupt in a user's script, say): it shares no Python-level lock with the
    I/O thread (``queue.Queue``'s condition variables are left held by an exception
    that lands inside them, and both threads then wait forever). Buffers go through a
    ``SimpleQueue`` (C, atomic put and get), waits are short polls, and the I/O thread
    stops once :meth:`close` was called and nothing is left to write, so a lost end
    marker cannot leave :meth:`close` joining forever.
    """

    _SYNC = object()  # queue marker: flush and fsync what was written so far
    _CUT = object()  # queue marker: end the current segment (:meth:`cut`)
    _POLL_S = 0.05  # the I/O thread's wait for work; bounds how late it notices close()
    _WAIT_S = 0.0005  # the writer's poll while the queue is full or draining

    def __init__(self, sink: BinaryIO, max_pending: int = 16):
        self._sink = sink
        self._pos = 0
        self.sha256 = hashlib.sha256()
        self.segments: list[tuple[int, int, str]] = []  # (start, end, sha256 hex) of each segment cut so far
        self._segment, self._segment_start, self._io_pos = hashlib.sha256(), 0, 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._max_pending = max_pending
        self._sent = 0  # buffers queued (the writer's thread only)
        self._done = 0  # buffers handled (the I/O thread only)
        self._closing = False
        self._abandoned = False  # the file is being discarded: nothing more needs writing
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="rollshard-shard-io", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                data = self._queue.get(timeout=self._POLL_S)
            except queue.Empty:
                if self._closing:
                    return
                continue
            if data is None:  # put only by close(), after everything else: nothing is left to write
                return
            try:
                if self._error is not None or self._abandoned:
                    pass
                elif data is self._SYNC:
                    self._sink.flush()
                    os.fsync(self._sink.fileno())
                elif data is self._CUT:
                    self._end_segment()
                else:
                    self.sha256.update(data)
                    self._segment.update(data)
                    self._io_pos += len(data)
                    self._sink.write(data)
            except BaseException as e:  # re-raised on the writer's thread at the next call
                self._error = e
            finally:
                self._done += 1

    def _end_segment(self) -> None:
        self.segments.append((self._segment_start, self._io_pos, self._segment.hexdigest()))
        self._segment, self._segment_start = hashlib.sha256(), self._io_pos

    def cut(self) -> None:
        """End the current segment here: :attr:`segments` gets its byte range and sha256 (the bytes written since
        the last cut; the writer cuts at row group boundaries). :meth:`close` cuts the last one."""
        self._put(self._CUT)

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def _put(self, item: Any) -> None:
        while self._sent - self._done >= self._max_pending:
            self._check_thread()
            time.sleep(self._WAIT_S)
        self._queue.put(item)
        self._sent += 1

    def _wait_drained(self) -> None:
        while self._done < self._sent:
            self._check_thread()
            time.sleep(self._WAIT_S)

    def _check_thread(self) -> None:
        if not self._thread.is_alive():
            raise OSError("the shard's I/O thread stopped before the shard was complete")

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        self._raise_pending()
        chunk = bytes(data)  # the caller may reuse its buffer once write returns
        self._put(chunk)
        self._pos += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._pos

    def sync_in_background(self) -> None:
        """Start an fsync of what is written so far on the I/O thread; the commit's own
        fsync then only waits for the bytes written after it."""
        if hasattr(self._sink, "fileno"):
            self._put(self._SYNC)

    def flush(self) -> None:
        if self._abandoned:
            return
        self._wait_drained()
        self._raise_pending()
        self._sink.flush()

    def close(self) -> None:
        if not self.closed:
            self._closing = True  # the I/O thread writes what is queued, then stops
            self._queue.put(None)  # wakes it now rather than at its next poll
            while self._thread.is_alive():
                self._thread.join(self._POLL_S)
        super().close()
        if not self._abandoned:
            self._raise_pending()
            if self._io_pos > self._segment_start:
                self._end_segment()

    def abandon(self) -> None:
        """Close without writing what is still queued and without raising the I/O thread's error: for a file being
        discarded, which may be torn in any state (an interrupt can land while the I/O thread is being started)."""
        self._abandoned = True
        self.close()


class Storage:
    """A dataset root on some filesystem."""

    def __init__(self, root: str | os.PathLike, filesystem: pafs.FileSystem | None = None):
        root = os.fspath(root)
        if filesystem is not None:
            self.fs, self.root = filesystem, root.rstrip("/")
        elif "://" in root:
            if root.startswith("s3://") and "?" in root:
                raise ValueError(f"dataset location {root!r}: give S3 settings through the environment "
                                 "(AWS_ENDPOINT_URL, AWS_DEFAULT_REGION, AWS_PROFILE), not in the URI")
            try:
                self.fs, self.root = pafs.FileSystem.from_uri(root)
            except Exception as e:  # pyarrow raises several types for bad URIs
                raise ValueError(f"cannot open dataset location {root!r}: {e}") from e
        else:
            self.fs, self.root = pafs.LocalFileSystem(), str(Path(root).resolve())
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self.s3 = isinstance(self.fs, pafs.S3FileSystem)
        self._explicit_fs = filesystem is not None
        self.uri = f"s3://{self.root}" if self.s3 and "://" not in root else root  # readers reopen it by URI
        self._bucket = None

    @property
    def bucket(self):
        """The boto3 side of an S3 dataset (store/io/s3.py), made on first use."""
        if self._bucket is None:
            from rollshard.store.io.s3 import Bucket, S3Error

            if self._explicit_fs:  # boto3 cannot take over its endpoint and credentials: writes would go elsewhere
                raise S3Error(f"{self.uri}: writing through a given S3FileSystem is not supported; pass the s3:// "
                              "URI and give the endpoint and credentials through the environment (AWS_ENDPOINT_URL)")

            self._bucket = Bucket(self.fs)
        return self._bucket

    def claim(self, writer_id: str, manifest_rel: str, *, lease_seconds: float | None = None,
              lease_wait_seconds: float | None = None) -> "Claim":
        """Hold ``writer_id`` for this process (module docstring) until the claim's ``release``."""
        if self.s3:
            from rollshard.store.io.s3 import LEASE_SECONDS, Claim as S3Claim

            return S3Claim(self.bucket, self.root, uri=self.uri, writer_id=writer_id, manifest_rel=manifest_rel,
                           lease_seconds=lease_seconds or LEASE_SECONDS,
                           lease_wait_seconds=LEASE_SECONDS if lease_wait_seconds is None else lease_wait_seconds)
        return Claim(self, writer_id, manifest_rel)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def makedirs(self, rel: str) -> None:
        if not self.s3:  # S3 has no directories: pyarrow would only add empty marker objects
            self.fs.create_dir(self.path(rel), recursive=True)

    def list(self, rel_dir: str, suffix: str) -> list[str]:
        """Relative paths of the files directly under ``rel_dir`` ending in ``suffix``, sorted."""
        sel = pafs.FileSelector(self.path(rel_dir), allow_not_found=True)
        names = [i.base_name for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File]
        return sorted(f"{rel_dir}/{n}" for n in names if n.endswith(suffix) and not n.startswith("."))

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def size(self, rel: str) -> int:
        return self.fs.get_file_info(self.path(rel)).size

    def sha256(self, rel: str, chunk: int = 8 << 20) -> str:
        h = hashlib.sha256()
        with self.fs.open_input_stream(self.path(rel)) as f:
            while block := f.read(chunk):
                h.update(block)
        return h.hexdigest()

    def delete(self, rel: str) -> None:
        try:
            self.fs.delete_file(self.path(rel))
        except FileNotFoundError:
            pass

    def remove_atomic_leftovers(self, rel: str) -> list[str]:
        """Delete the temporary files a crash inside :meth:`write_atomic` of ``rel`` left behind (the caller
        must own ``rel``: another process may be writing its own). Returns the removed paths."""
        if not self.local:
            return []
        final = Path(self.path(rel))
        # Exactly the names of store/common.py write_atomic (".NAME.<32 hex>.tmp"): a looser glob would also match
        # the live temp file of another writer whose id extends this one's (".gen.json.x.json.<hex>.tmp" for
        # "gen.json.x").
        mine = re.compile(rf"\.{re.escape(final.name)}\.[0-9a-f]{{32}}\.tmp")
        removed = []
        for tmp in final.parent.glob(f".{final.name}.*.tmp"):
            if mine.fullmatch(tmp.name):
                tmp.unlink(missing_ok=True)
                removed.append(str(tmp))
        return removed

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write a small file (a manifest) so readers see the old or the new content, never a mix."""
        if not self.local:
            with self.fs.open_output_stream(self.path(rel)) as f:
                f.write(data)
            return
        write_atomic(self.path(rel), data)


class Claim:
    """What a writer holds while it writes as one writer id, on a local or other filesystem (S3: store/io/s3.py):
    a ``flock`` locally, nothing elsewhere (module docstring); its manifest is written with :meth:`Storage.write_atomic`."""

    took_over = False  # S3 only: the writer id was another (dead) process's lease

    def __init__(self, storage: Storage, writer_id: str, manifest_rel: str):
        self.storage, self.writer_id, self._manifest = storage, writer_id, manifest_rel
        self.token = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:12]}"  # this process's claim
        self._fd: int | None = None
        storage.makedirs(str(Path(manifest_rel).parent))
        if storage.local:
            fd = os.open(storage.path(f"{Path(manifest_rel).parent}/{writer_id}.lock"), os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                os.close(fd)
                raise ClaimError(
                    f"another process is writing into {storage.uri} as writer {writer_id!r}; "
                    "give each process its own writer id"
                ) from e
            self._fd = fd

    def load_manifest(self) -> bytes | None:
        return self.storage.read_bytes(self._manifest) if self.storage.exists(self._manifest) else None

    def save_manifest(self, data: bytes) -> None:
        self.storage.write_atomic(self._manifest, data)

    def check(self) -> None:
        pass

    def clean_uploads(self) -> int:
        return 0

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


class ClaimError(RuntimeError):
    """Another process holds the writer id."""


class PendingFile:
    """A file being written that becomes visible at ``rel`` only on :meth:`commit` (module docstring)."""

    def __init__(self, storage: Storage, rel: str):
        self.storage, self.rel = storage, rel
        self._tmp: str | None = None  # local and other filesystems: written here, moved to rel on commit
        self._upload = None  # S3: completed on commit
        if storage.s3:
            from rollshard.store.io.s3 import Upload

            self._upload = Upload(storage.bucket, storage.path(rel))
            self._raw: Any = self._upload
        else:
            storage.makedirs(TMP_DIR)
            self._tmp = f"{TMP_DIR}/{uuid.uuid4().hex}~{Path(rel).name}"
            self._raw = (open(storage.path(self._tmp), "wb") if storage.local
                         else storage.fs.open_output_stream(storage.path(self._tmp)))
        self.file = HashingFile(self._raw)

    def commit(self) -> tuple[str, int]:
        """Make the file visible; returns (sha256 hex, size in bytes)."""
        size = self.file.tell()
        self.file.close()  # drains the background writes and hash
        if self._upload is not None:
            self._upload.complete()
        elif self.storage.local:
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
            final = Path(self.storage.path(self.rel))
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.storage.path(self._tmp), final)
            fsync_dir(final.parent)
        else:
            self._raw.close()  # completes the upload of the temporary file
            self.storage.fs.move(self.storage.path(self._tmp), self.storage.path(self.rel))
        return self.file.sha256.hexdigest(), size

    def discard(self) -> None:
        """Drop the file; nothing becomes visible at ``rel``."""
        try:
            try:
                self.file.abandon()
            finally:
                if self._upload is not None:
                    self._upload.abort()
                else:
                    self._raw.close()
        finally:
            if self._tmp is not None:
                self.storage.delete(self._tmp)

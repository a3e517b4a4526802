"""Where a dataset lives: a local directory, or any pyarrow filesystem URI (``s3://...``).

The commit protocol needs three operations: write a file so that it appears whole or
not at all, list files, and read them. Locally that is write-temp, fsync, rename (plus
an fsync of the directory so the rename itself survives a power cut). On object stores
an upload becomes visible only when it completes, so the file is written straight to
its final key.
"""

from __future__ import annotations

import hashlib
import io
import os
import queue
import threading
import uuid
from pathlib import Path
from typing import BinaryIO

import pyarrow.fs as pafs

TMP_DIR = "_tmp"  # underscore: pyarrow.dataset and most readers skip it


class HashingFile(io.RawIOBase):
    """A write-only file that feeds every byte to sha256 on its way to ``sink``.

    Hashing while writing saves re-reading a shard to checksum it. The hash and the
    write run on a background thread (hashlib and file writes release the GIL), so they
    overlap with Parquet encoding instead of adding to it; at most ``max_pending``
    buffers wait in between.
    """

    _SYNC = b""  # queue marker: flush and fsync what was written so far

    def __init__(self, sink: BinaryIO, max_pending: int = 16):
        self._sink = sink
        self._pos = 0
        self.sha256 = hashlib.sha256()
        self._queue: queue.Queue[bytes | None] = queue.Queue(max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="rollshard-shard-io", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                if self._error is None and data is self._SYNC:
                    self._sink.flush()
                    os.fsync(self._sink.fileno())
                elif self._error is None:
                    self.sha256.update(data)
                    self._sink.write(data)
            except BaseException as e:  # re-raised on the writer's thread at the next call
                self._error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        self._raise_pending()
        chunk = bytes(data)  # the caller may reuse its buffer once write returns
        self._queue.put(chunk)
        self._pos += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._pos

    def sync_in_background(self) -> None:
        """Start an fsync of what is written so far on the I/O thread; the commit's own
        fsync then only waits for the bytes written after it."""
        if hasattr(self._sink, "fileno"):
            self._queue.put(self._SYNC)

    def flush(self) -> None:
        self._queue.join()
        self._raise_pending()
        self._sink.flush()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        super().close()
        self._raise_pending()


class Storage:
    """A dataset root on some filesystem."""

    def __init__(self, root: str | os.PathLike, filesystem: pafs.FileSystem | None = None):
        root = os.fspath(root)
        if filesystem is not None:
            self.fs, self.root = filesystem, root.rstrip("/")
        elif "://" in root:
            try:
                self.fs, self.root = pafs.FileSystem.from_uri(root)
            except Exception as e:  # pyarrow raises several types for bad URIs
                raise ValueError(f"cannot open dataset location {root!r}: {e}") from e
        else:
            self.fs, self.root = pafs.LocalFileSystem(), str(Path(root).resolve())
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self.uri = root

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def makedirs(self, rel: str) -> None:
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

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write a small file (a manifest) so readers see the old or the new content, never a mix."""
        if not self.local:
            with self.fs.open_output_stream(self.path(rel)) as f:
                f.write(data)
            return
        final = Path(self.path(rel))
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)


class PendingFile:
    """A file being written that becomes visible at ``rel`` only on :meth:`commit`."""

    def __init__(self, storage: Storage, rel: str):
        self.storage, self.rel = storage, rel
        if storage.local:
            storage.makedirs(TMP_DIR)
            self._tmp = Path(storage.path(f"{TMP_DIR}/{uuid.uuid4().hex}~{Path(rel).name}"))
            self._raw: BinaryIO = open(self._tmp, "wb")
        else:
            self._tmp = None
            self._raw = storage.fs.open_output_stream(storage.path(rel))
        self.file = HashingFile(self._raw)

    def commit(self) -> tuple[str, int]:
        """Make the file visible; returns (sha256 hex, size in bytes)."""
        size = self.file.tell()
        self.file.close()  # drains the background writes and hash
        if self._tmp is not None:
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
            final = Path(self.storage.path(self.rel))
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self._tmp, final)
            _fsync_dir(final.parent)
        else:
            self._raw.close()  # completes the upload
        return self.file.sha256.hexdigest(), size

    def discard(self) -> None:
        """Drop the file; nothing becomes visible. Object stores only abort an upload on close
        when it has not completed, which pyarrow cannot express, so a remote partial is deleted."""
        try:
            try:
                self.file.close()
            finally:
                self._raw.close()
        finally:
            if self._tmp is not None:
                self._tmp.unlink(missing_ok=True)
            else:
                self.storage.delete(self.rel)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

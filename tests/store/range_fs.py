"""A filesystem whose reads are recorded, for counting the bytes a loader reads (tests and tests/bench)."""

from __future__ import annotations

import threading


class RangeFS:
    """A local filesystem whose reads are recorded as (path, first byte, byte count)."""

    def __init__(self):
        import pyarrow.fs as pafs

        self.fs, self.reads, self.lock = pafs.LocalFileSystem(), [], threading.Lock()

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def open_input_file(self, path: str):
        return _RangeFile(self.fs.open_input_file(path), path, self)

    def open_input_stream(self, path: str):
        return _RangeFile(self.fs.open_input_file(path), path, self)

    def add(self, path: str, offset: int, n: int) -> None:
        with self.lock:
            self.reads.append((path, offset, n))

    def total(self) -> int:
        return sum(n for _, _, n in self.reads)

    def touched(self, path: str, byte: int) -> bool:
        return any(p == path and o <= byte < o + n for p, o, n in self.reads)


class _RangeFile:
    def __init__(self, f, path: str, fs: RangeFS):
        self.f, self.path, self.fs, self.closed = f, path, fs, False

    def read(self, n: int = -1) -> bytes:
        at = self.f.tell()
        data = self.f.read() if n is None or n < 0 else self.f.read(n)
        self.fs.add(self.path, at, len(data))
        return data

    def read_at(self, n: int, offset: int) -> bytes:
        data = self.f.read_at(n, offset)
        self.fs.add(self.path, offset, len(data))
        return data

    def readinto(self, b) -> int:
        at = self.f.tell()
        n = self.f.readinto(b)
        self.fs.add(self.path, at, n)
        return n

    def read_buffer(self, n: int):
        at = self.f.tell()
        buf = self.f.read_buffer(n)
        self.fs.add(self.path, at, buf.size)
        return buf

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def size(self) -> int:
        return self.f.size()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

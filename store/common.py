"""The helpers every stage shares, each defined once: errors and exit statuses, one-line messages, figures shown,
atomic file writes, file digests and timestamps, retry backoff, progress bars. generate and train import them from
here (imports run generate -> store <- train).

The store's error for damaged or foreign data: :class:`DataError`.

A file can break a promise the dataset makes (a checksum, a column type, a row
invariant, a path inside the dataset). Those are not bugs and not usage errors, so
every store reader raises one type for them, whose message is one line naming the
shard (its path relative to the dataset), the row (sample id) when there is one, and
what is wrong. Commands print that line and exit non-zero; no traceback.

It subclasses ValueError so that callers catching ValueError for bad input (the
trainer's command line does) keep working.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import random
import sys
import uuid
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A shard or manifest breaks the dataset's contract; the message names the file and the row."""


class UsageError(Exception):
    """Something the user can fix (a flag, a path, a setting): printed as one line saying what is wrong and how to
    fix it, exit status 2 (:data:`EXIT_USAGE`), nothing written. Not a ValueError: a handler of a library's
    ValueError around a call must not take it for one."""


# The exit statuses of every rollshard command: done; done with failures (or problems found, or a threshold
# exceeded); no answer (bad input, damaged data: one line saying what and how to fix it); interrupted (Ctrl-C).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def one_line(e: BaseException | str) -> str:
    """An error's message on one line, as a command prints it: library errors (pyarrow's among them) may span
    several lines, each joined to the next by "; ", runs of whitespace collapsed; the error's type when it has no
    message."""
    lines = (" ".join(part.split()) for part in str(e).splitlines())
    return "; ".join(p for p in lines if p) or type(e).__name__


def show_number(x: float | None, spec: str) -> str:
    """A figure in a table or a page: ``format(x, spec)``, or "-" for none."""
    return "-" if x is None else format(x, spec)


def print_error(prog: str, e: BaseException | str) -> None:
    """A command's error, as every rollshard command prints it: ``PROG: error: MESSAGE``, one line on stderr."""
    print(f"{prog}: error: {one_line(e)}", file=sys.stderr)


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a local file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def utc_now() -> str:
    """Now, as the manifests record a time: ISO 8601 in UTC, to the millisecond."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a folder's entries (a rename into it, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, durable: bool = True) -> None:
    """``data`` to the local file ``path``, all or nothing: a temporary file beside it, fsynced, renamed over it (the
    folder fsynced after). A reader sees the old file or the new one, never a part. ``durable=False`` skips the
    fsyncs for files rewritten often whose loss in a power cut is harmless (a crash still leaves old or new)."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(final.parent)


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """The retry delay of every retrying loop: exponential backoff with "equal jitter", half the step fixed, half
    uniform (so retries of many clients spread out). ``attempt`` counts from 0; the step is ``base * 2**attempt``,
    at most ``cap``."""
    step = min(cap, base * 2**attempt)
    return step / 2 + (rng or random).uniform(0, step / 2)


def progress(total: int | None = None, desc: str = "", unit: str = "it", **kwargs: Any):
    """The progress bar of every long command (tqdm, on stderr; hidden when stderr is not a terminal unless
    ``disable=False`` is given)."""
    from tqdm import tqdm

    kwargs.setdefault("disable", None)  # None: off when not a TTY
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(total=total, desc=desc, unit=unit, **kwargs)

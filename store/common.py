"""The store's error for damaged or foreign data: :class:`DataError`.

A file can break a promise the dataset makes (a checksum, a column type, a row
invariant, a path inside the dataset). Those are not bugs and not usage errors, so
every store reader raises one type for them, whose message is one line naming the
shard (its path relative to the dataset), the row (sample id) when there is one, and
what is wrong. Commands print that line and exit non-zero; no traceback.

It subclasses ValueError so that callers catching ValueError for bad input (the
trainer's command line does) keep working.
"""

from __future__ import annotations


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

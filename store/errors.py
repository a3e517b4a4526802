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

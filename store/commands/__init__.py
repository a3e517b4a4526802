"""``rollshard-store``: ``validate``, ``stats`` and ``inspect`` a dataset; ``filter`` it into a new one; ``report``
one or more datasets (and a run's metrics, an audit report) as one HTML page.

One module per command (its lookup: what it reads and computes), the rich tables in :mod:`.tables` and
:mod:`.sample_tables` (the rendering), the parser in :mod:`.parser` and the entry point in :mod:`.main`.

Exit status: 0 done (``validate``: no problem found); 1 ``validate`` found problems; 2 no answer: a usage error
(bad arguments, no dataset at the path, a schema newer than this rollshard reads, in any shard, an unknown
``--sample``, an unreadable ``--audit`` or ``--metrics`` file, an ``--audit`` of none of the datasets given (the
report names what it audited: its datasets' fingerprints; one of audit schema 1.0 names none and is paired by
sample_id alone, with a warning), a dataset without rows to ``report`` or a ``report --out`` that is a folder, a
file other than a report page, in no folder or a URI (checked before the page is built); for ``filter`` an
``--agent`` the dataset does not have, an ``--out`` that is not new, or a rerun into it with other filters or a
changed parent), or damaged data: ``stats``, ``inspect``, ``report`` and ``filter`` check every shard they read
against its manifest (size, footer, checksums) before they use any row, and refuse one that differs, is cut short
or is not readable as Parquet in one line naming it (:class:`~rollshard.store.common.DataError`), nothing
written; only ``validate`` answers with its problems; 130 ``filter`` interrupted (rerun the same command to
resume). ``--json`` prints one JSON document on stdout and nothing else there; progress goes to stderr when it
is a terminal.
"""

from rollshard.store.commands.main import main
from rollshard.store.commands.parser import PROG, build_parser

__all__ = ["PROG", "build_parser", "main"]

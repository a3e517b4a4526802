"""``rollshard-store``'s entry point: parse the command line, run the command, and turn what refuses it (bad
input, damaged data) into one line and an exit status."""

from __future__ import annotations

import argparse

import polars as pl
import pyarrow as pa

from rollshard.store.commands import filter as filter_command
from rollshard.store.commands import inspect, report, stats, validate
from rollshard.store.commands.console import Context, error
from rollshard.store.commands.parser import PROG, build_parser
from rollshard.store.common import EXIT_INTERRUPTED, EXIT_USAGE, DataError, UsageError, one_line
from rollshard.store.derived.derive import DeriveError
from rollshard.store.format.schema import RowInvariantError, SchemaVersionError
from rollshard.store.inspection.audit import AuditSchemaError
from rollshard.store.io.dataset import DatasetNotFoundError

COMMANDS = {"validate": validate.run, "stats": stats.run, "inspect": inspect.run, "filter": filter_command.run,
            "report": report.run}
REFUSED = (UsageError, DatasetNotFoundError, SchemaVersionError, DeriveError, AuditSchemaError, DataError,
           OSError, pa.ArrowException, pl.exceptions.PolarsError, ValueError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = COMMANDS[args.command]
    try:
        return run(args, Context.open(argv))
    except KeyboardInterrupt:
        error("interrupted; rerun the same command to resume")
        return EXIT_INTERRUPTED
    except REFUSED as e:
        error(refusal(e, args))
        return EXIT_USAGE


def refusal(e: Exception, args: argparse.Namespace) -> str:
    """The one line a refused command prints. Damaged data is no answer (exit 2), as bad input is: only validate
    answers with its problems (exit 1)."""
    where = " ".join(args.paths) if args.command == "report" else args.path  # report reads several
    if isinstance(e, (UsageError, DatasetNotFoundError, SchemaVersionError, DeriveError)):
        return str(e)
    if isinstance(e, AuditSchemaError):  # before DataError: a bad --audit file is a usage error
        return f"--audit: {e}"
    if isinstance(e, RowInvariantError):  # a parent row the writer refuses: the parent is damaged
        return f"{where}: {e}; run `{PROG} validate {where}`"
    if isinstance(e, DataError):  # a damaged shard or manifest: the message names it and points at validate
        return f"{where}: {e}"
    if isinstance(e, (OSError, pa.ArrowException, pl.exceptions.PolarsError)):  # before ValueError: ArrowInvalid is one
        return f"cannot read {where}: {one_line(e)}; run `{PROG} validate` on it"
    return str(e)  # a location pyarrow cannot open, an unreadable manifest

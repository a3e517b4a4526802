"""``rollshard-store validate``: every invariant, checksum and count of a dataset, shard by shard; exit 1 on any
problem (the only command that answers with what is wrong instead of refusing)."""

from __future__ import annotations

import argparse

from rollshard.store.commands import tables
from rollshard.store.commands.console import Context, print_json
from rollshard.store.common import EXIT_FAILED, EXIT_OK, progress
from rollshard.store.io.validate import ValidationReport, Validator

EXIT_PROBLEMS = EXIT_FAILED  # validate found problems


def run(args: argparse.Namespace, ctx: Context) -> int:
    report = check(args.path, hidden=args.no_progress)
    if args.json:
        print_json(ctx.out, report.to_dict())
    else:
        for renderable in tables.validation(report):
            ctx.out.print(renderable)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def check(path: str, *, hidden: bool) -> ValidationReport:
    validator = Validator(path)
    with progress(total=len(validator.shards), desc="validate", unit="shard", leave=False,
                  disable=True if hidden else None) as bar:
        for shard in validator.shards:
            validator.check_shard(shard)
            bar.update(1)
    return validator.finish()

"""``rollshard-store filter``: the rows of a dataset that pass every filter given, written into a new dataset
with the lineage recorded (:func:`rollshard.store.derived.filter.filter_dataset`)."""

from __future__ import annotations

import argparse
import shlex

import polars as pl

from rollshard.store.commands.console import Context, print_json
from rollshard.store.commands.parser import PROG
from rollshard.store.common import EXIT_OK, UsageError
from rollshard.store.derived.filter import (RowFilter, filter_dataset, parse_list, parse_weight_versions,
                                            read_sample_ids)
from rollshard.store.io.dataset import RolloutDataset, check_dataset_out


def run(args: argparse.Namespace, ctx: Context) -> int:
    row_filter = parse_filter(args)
    check_dataset_out(args.out, fix="give a new or empty folder, or the unfinished output of this filter to resume")
    ds = RolloutDataset.open(args.path)
    check_agents(ds, row_filter, args.path)
    command = shlex.join([PROG, *ctx.argv])
    result = filter_dataset(
        ds, args.out, row_filter, command=command, writer_id=args.writer_id, progress=not args.no_progress
    )
    if args.json:
        print_json(ctx.out, result.to_dict())
    else:
        print(f"{PROG} filter: {args.path} -> {args.out}: {result.summary()}", file=ctx.out.file)
    return EXIT_OK


def parse_filter(args: argparse.Namespace) -> RowFilter:
    """The filters of the command line; a bad value is a usage error naming its flag."""
    try:
        versions, version_range = None, None
        if args.weight_version is not None:
            versions, version_range = parse_weight_versions(args.weight_version)
        return RowFilter(
            agents=None if args.agent is None else parse_list(args.agent, "--agent"),
            statuses=None if args.status is None else parse_list(args.status, "--status"),
            min_reward=number(args.min_reward, "--min-reward"),
            max_reward=number(args.max_reward, "--max-reward"),
            weight_versions=versions,
            weight_version_range=version_range,
            sample_ids=None if args.sample_ids is None else read_sample_ids(args.sample_ids),
        )
    except ValueError as e:
        raise UsageError(f"filter: {e}") from e


def check_agents(ds: RolloutDataset, row_filter: RowFilter, path: str) -> None:
    """Every ``--agent`` is one the dataset has (a typo would otherwise write an empty dataset)."""
    if row_filter.agents is None:
        return
    present = set(ds.scan().select(pl.col("agent").unique()).collect()["agent"].to_list())
    missing = sorted(set(row_filter.agents) - present)
    if missing:
        have = ", ".join(sorted(present)) or "none: the dataset has no rows"
        raise UsageError(f"filter: --agent {missing[0]!r}: no such agent in {path} (agents: {have})")


def number(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a number") from None

"""``rollshard-store stats``: rows, groups, tokens and bytes; rows by status; rows, tokens and reward by agent."""

from __future__ import annotations

import argparse

from rollshard.store.commands import tables
from rollshard.store.commands.console import Context, busy, print_json
from rollshard.store.common import EXIT_OK
from rollshard.store.inspection.stats import dataset_stats
from rollshard.store.io.dataset import RolloutDataset


def run(args: argparse.Namespace, ctx: Context) -> int:
    ds = RolloutDataset.open(args.path)
    ds.verify()  # every byte against the manifests before any figure is drawn from them
    with busy("scanning shards"):
        st = dataset_stats(ds)
    if args.json:
        print_json(ctx.out, st)
    else:
        for table in tables.stats(st):
            ctx.out.print(table)
    return EXIT_OK

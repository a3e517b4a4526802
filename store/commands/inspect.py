"""``rollshard-store inspect``: a dataset's summary tables (run config, lineage, writers, rows by status, reward
by agent and round, lengths, zero-variance groups, weight versions), or one sample with ``--sample``."""

from __future__ import annotations

import argparse

from rollshard.store.commands import sample, sample_tables, tables
from rollshard.store.commands.console import Context, busy, print_json
from rollshard.store.common import EXIT_OK
from rollshard.store.inspection.stats import inspect_summary
from rollshard.store.io.dataset import RolloutDataset


def run(args: argparse.Namespace, ctx: Context) -> int:
    ds = RolloutDataset.open(args.path)
    ds.verify()  # every byte against the manifests before any figure is drawn from them
    if args.sample is not None:
        view = sample.look_up(ds, args)
        if args.json:
            print_json(ctx.out, view.to_dict())
        else:
            for renderable in sample_tables.sample(view, max_tokens=args.max_tokens):
                ctx.out.print(renderable)
        return EXIT_OK
    with busy("scanning shards"):
        summary = inspect_summary(ds)
    if args.json:
        print_json(ctx.out, summary)
    else:
        for table in tables.summary(summary):
            ctx.out.print(table)
    return EXIT_OK

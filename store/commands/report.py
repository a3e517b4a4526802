"""``rollshard-store report``: one self-contained HTML page of the notebooks' views of one or more datasets (and
an audit report, a run's metrics), built by :mod:`rollshard.store.inspection.report`."""

from __future__ import annotations

import argparse
import os
import sys

from rollshard.store.commands.console import Context, warning
from rollshard.store.commands.parser import PROG
from rollshard.store.common import EXIT_OK, UsageError, one_line, progress
from rollshard.store.io.dataset import DatasetNotFoundError, RolloutDataset
from rollshard.store.io.destination import check_out_file


def run(args: argparse.Namespace, ctx: Context) -> int:
    check_inputs(args)
    text = write_page(args)
    print(f"{PROG} report: wrote {args.out} ({len(text.encode()) / 1e6:.1f} MB)", file=sys.stderr)
    return EXIT_OK


def check_inputs(args: argparse.Namespace) -> None:
    """What can be refused before the page is built: the --out path (a local file in a folder that exists, new or
    a page this command wrote), the --audit and --metrics files, and every byte of the datasets against their
    manifests."""
    from rollshard.store.inspection import report

    try:
        report.check_out(args.out)
    except ValueError as e:
        raise UsageError(str(e)) from e
    check_out_file(args.out, own=report.is_page, kind="a rollshard report page",
                   fix="name a new file, or a page this command wrote to replace it")
    for path, flag in ((args.audit, "--audit"), (args.metrics, "--metrics")):
        if path is not None and "://" not in path and not os.path.isfile(path):
            raise UsageError(f"{flag} {path}: no such file")
    for path in args.paths:  # every byte against the manifests before any figure is drawn from them
        RolloutDataset.open(path).verify()


def write_page(args: argparse.Namespace) -> str:
    """The page, built and written to --out; its text."""
    from rollshard.store.inspection import report
    from rollshard.store.inspection.views.figures import MissingPlotting
    from rollshard.store.inspection.views.metrics import MetricsError
    from rollshard.store.inspection.views.mismatch import AuditDatasetError

    with progress(desc="report: starting", bar_format="{desc} ({elapsed})", leave=False,
                  disable=True if args.no_progress else None) as bar:
        try:
            text = report.build(args.paths, audit=args.audit, metrics=args.metrics,
                                step=lambda name: bar.set_description_str(f"report: {name}"), warn=warning)
        except (MissingPlotting, MetricsError) as e:
            raise UsageError(str(e)) from e
        except AuditDatasetError as e:
            raise UsageError(f"--audit {e}") from e
        except DatasetNotFoundError:
            raise  # its message says what is missing and how to make one
        except FileNotFoundError as e:  # the audit file vanished, or an S3 key that does not exist
            flag = {args.audit: "--audit ", args.metrics: "--metrics "}.get(e.filename, "") if e.filename else ""
            raise UsageError(f"{flag}{e.filename or one_line(e)}: no such file") from e
        bar.set_description_str(f"report: writing {args.out}")
        try:
            report.write(text, args.out)
        except ValueError as e:  # the folder went away while the page was built
            raise UsageError(str(e)) from e
    return text

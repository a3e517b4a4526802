"""``rollshard-store``: ``validate``, ``stats`` and ``inspect`` a dataset; ``filter`` it into a new one; ``report``
one or more datasets (and a run's metrics, an audit report) as one HTML page.

Exit status: 0 done (``validate``: no problem found); 1 ``validate`` found problems, or
the data could not be read (``stats`` and ``inspect`` refuse a shard that is missing,
cut short or not the manifest's size, :class:`~rollshard.store.common.DataError`, with one
line naming it; they do not hash shards: ``validate`` checks the checksums; ``filter``
refuses a parent shard whose sha256 is not its manifest's); 2 a usage error
(bad arguments, no dataset at the path, a schema newer than this rollshard reads, in
any shard, an unknown ``--sample``, an unreadable ``--audit`` or ``--metrics`` file, an ``--audit`` of none of
the datasets given (the report names what it audited: its datasets' fingerprints; one of audit schema 1.0
names none and is paired by sample_id alone, with a warning), a dataset without rows to ``report`` or a
``report --out`` that is a folder, in no folder or a URI (checked before the page is built); for ``filter``
an ``--agent`` the dataset does not have, an ``--out`` that is not new, or a rerun into it with other filters
or a changed parent); 130 ``filter`` interrupted (rerun the same command to resume). ``--json`` prints one
JSON document on stdout and nothing else there; progress goes to stderr when it is a
terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections import Counter
from contextlib import nullcontext
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from rollshard.store.inspection.audit import AuditSchemaError
from rollshard.store.io.dataset import DatasetNotFoundError, RolloutDataset
from rollshard.store.derived.derive import DeriveError
from rollshard.store.common import DataError, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError, one_line
from rollshard.store.format.groups import REWARD_STD_DDOF
from rollshard.store.format.lineage import DERIVED_KEY, LINEAGE_KEY
from rollshard.store.format.schema import RowInvariantError, SchemaVersionError

EXIT_PROBLEMS = EXIT_FAILED  # validate found problems
PROG = "rollshard-store"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Check and summarize a rollshard dataset directory.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{validate,stats,inspect,filter,report}")

    v = sub.add_parser("validate", help="re-check every invariant, checksum and count; exit 1 on any problem")
    v.add_argument("path", help="dataset directory (or pyarrow filesystem URI)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")

    s = sub.add_parser("stats", help="rows, groups, tokens, bytes; rows by status; rows, tokens and reward by agent")
    s.add_argument("path", help="dataset directory (or pyarrow filesystem URI)")
    s.add_argument("--json", action="store_true", help="print the numbers as JSON")

    i = sub.add_parser("inspect", help="summary tables, or one sample's tokens with --sample")
    i.add_argument("path", help="dataset directory (or pyarrow filesystem URI)")
    i.add_argument("--sample", metavar="ID",
                   help="show one row's tokens, logprobs and loss mask: its sample_id, or 'first' or 'random', or "
                        "'worst-mismatch' (with --audit: the row of the largest |trainer - rollout| logprob)")
    i.add_argument("--audit", metavar="AUDIT.parquet",
                   help="a rollshard-train audit report of this dataset (refused for another one): --sample shows the "
                        "trainer logprob beside the rollout one")
    i.add_argument("--json", action="store_true", help="print as JSON")
    i.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer folder to decode tokens with (default: the model path in the run config, when it exists here)",
    )
    i.add_argument("--max-tokens", type=int, default=256, metavar="N", help="tokens shown with --sample (0: all)")

    f = sub.add_parser(
        "filter",
        help="write the rows that pass the filters into a new dataset, lineage recorded",
        description=(
            "Write the rows of DATASET that pass every filter given (at least one) into the new dataset --out. "
            "Filters are per row: a reward range can keep part of a GRPO group (the trainer normalizes the rows "
            "left); a group is never split across shards. A shard whose rows all pass is copied byte for byte, "
            "one with some rows left is rewritten, one with none is dropped. The lineage (parent, its fingerprint, the filters) is "
            "recorded in the new dataset's manifests and shown by `inspect`. Interrupted, rerun the same command: "
            "it resumes with the shards not done."
        ),
    )
    f.add_argument("path", metavar="DATASET", help="dataset directory (or pyarrow filesystem URI)")
    f.add_argument(
        "--out", required=True, metavar="NEW", help="new dataset directory (new or empty; not inside DATASET)"
    )
    f.add_argument("--agent", metavar="A[,B]", help="keep rows of these agents")
    f.add_argument(
        "--status", metavar="S[,S]", help="keep rows of these statuses (completed, truncated, aborted, failed)"
    )
    # numbers parsed after argparse, so that a bad value is one line (argparse would add its usage block)
    f.add_argument("--min-reward", metavar="X", help="keep rows with a finite reward >= X (rows without one dropped)")
    f.add_argument("--max-reward", metavar="X", help="keep rows with a finite reward <= X (rows without one dropped)")
    f.add_argument(
        "--weight-version", metavar="V[,V] | LO..HI",
        help="keep rows of these weight versions, or of an inclusive integer range (3..5, 3.., ..5)",
    )
    f.add_argument("--sample-ids", metavar="FILE", help="keep rows whose sample_id is in FILE (one id per line)")
    f.add_argument("--writer-id", default="filter", metavar="ID", help="prefix of the new dataset's writer ids")
    f.add_argument("--json", action="store_true", help="print the result as JSON")
    f.add_argument("--no-progress", action="store_true", help="no progress bar")

    r = sub.add_parser(
        "report",
        help="one self-contained HTML page of the notebooks' views (figures inline)",
        description=(
            "Write one self-contained HTML page (figures inline, no script, nothing fetched) with the views of "
            "notebooks/inspect_rollouts.ipynb: overview and run config, reward by agent and round, zero-variance "
            "groups, response lengths, logprobs, staleness by weight version, one trajectory token by token, one "
            "prompt across the agents. Several datasets are read as consecutive rounds (reward per agent across "
            "them); the last is detailed. --audit adds the trainer-vs-rollout logprob views, --metrics "
            "notebooks/train_metrics.ipynb's."
        ),
    )
    r.add_argument("paths", nargs="+", metavar="DATASET", help="dataset directories, oldest round first")
    r.add_argument("--out", required=True, metavar="REPORT.html",
                   help="the page to write, a local file (replaced atomically)")
    r.add_argument("--audit", metavar="AUDIT.parquet",
                   help="the per-token audit report of rollshard-train audit of one (or more) of the datasets")
    r.add_argument("--metrics", metavar="METRICS.jsonl", help="a training run's OUT/metrics.jsonl")
    r.add_argument("--no-progress", action="store_true", help="no progress display")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Console(highlight=False, soft_wrap=False)
    err = Console(stderr=True, highlight=False)
    try:
        if args.command == "validate":
            return _validate(args, out, err)
        if args.command == "filter":
            return _filter(args, out, argv)
        if args.command == "report":
            return _report(args, err)
        ds = RolloutDataset.open(args.path)
        ds.verify()  # every byte against the manifests before any figure is drawn from them
        if args.command == "stats":
            return _stats(ds, args, out, err)
        return _inspect(ds, args, out, err)
    except (DatasetNotFoundError, SchemaVersionError, UsageError, DeriveError) as e:
        _error(f"{e}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _error("interrupted; rerun the same command to resume")
        return EXIT_INTERRUPTED
    except AuditSchemaError as e:  # before DataError: a bad --audit file is a usage error
        _error(f"--audit: {e}")
        return EXIT_USAGE
    # Damaged data is no answer (exit 2), as bad input is: only validate answers with its problems (exit 1).
    except RowInvariantError as e:  # a parent row the writer refuses: the parent is damaged
        _error(f"{_datasets(args)}: {e}; run `{PROG} validate {_datasets(args)}`")
        return EXIT_USAGE
    except DataError as e:  # a damaged shard or manifest: the message names it and points at validate
        _error(f"{_datasets(args)}: {e}")
        return EXIT_USAGE
    except (OSError, pa.ArrowException, pl.exceptions.PolarsError) as e:  # before ValueError: ArrowInvalid is one
        _error(f"cannot read {_datasets(args)}: {one_line(e)}; run `{PROG} validate` on it")
        return EXIT_USAGE
    except ValueError as e:  # a location pyarrow cannot open, an unreadable manifest
        _error(f"{e}")
        return EXIT_USAGE


def _datasets(args) -> str:
    """The dataset(s) a command read, for an error line: ``report`` takes several."""
    return " ".join(args.paths) if args.command == "report" else args.path


# -- validate -------------------------------------------------------------------------------


def _validate(args, out: Console, err: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from rollshard.store.io.validate import Validator

    validator = Validator(args.path)
    columns = (TextColumn("validate"), BarColumn(), MofNCompleteColumn(), TextColumn("shards"), TimeRemainingColumn())
    with Progress(*columns, console=err, disable=args.no_progress or not err.is_terminal, transient=True) as bar:
        task = bar.add_task("shards", total=len(validator.shards))
        for shard in validator.shards:
            validator.check_shard(shard)
            bar.advance(task)
    report = validator.finish()
    if args.json:
        _print_json(out, report.to_dict())
        return EXIT_OK if report.ok else EXIT_PROBLEMS

    shards = Table(title=escape(f"{report.dataset}: {len(report.shards)} shards"))
    for col in ("shard", "writer", "rows", "bytes", "result"):
        shards.add_column(col, justify="right" if col in ("rows", "bytes") else "left")
    involved = Counter(path for p in report.problems for path in p.shards)  # cross-shard ones too
    for s in report.shards:
        n = involved[s.path]
        result = Text("ok", style="green") if not n else Text(f"{n} problem{'s' * (n > 1)}", style="red")
        _row(shards, s.path, s.writer_id, f"{s.rows:,}", f"{s.bytes:,}", result)
    out.print(shards)
    if report.problems:
        problems = Table(title="problems", show_lines=False)
        problems.add_column("where", overflow="fold")
        problems.add_column("check", style="bold")
        problems.add_column("detail", overflow="fold")
        for p in report.problems:
            _row(problems, "\n".join(p.shards) or "dataset", p.check, p.detail)
        out.print(problems)
    for w in report.warnings:
        out.print(Text("warning: ", style="yellow") + Text(w))
    rows = sum(s.rows for s in report.shards)
    if report.ok:
        out.print(f"[green]ok[/]: {len(report.shards)} shards, {rows:,} rows, every check passed")
        return EXIT_OK
    out.print(Text("FAILED", style="red") + Text(f": {len(report.problems)} problems in {report.dataset}"))
    return EXIT_PROBLEMS


# -- filter ---------------------------------------------------------------------------------


def _filter(args, out: Console, argv: list[str] | None) -> int:
    from rollshard.store.derived.filter import RowFilter, filter_dataset, parse_list, parse_weight_versions, read_sample_ids

    try:
        versions, version_range = None, None
        if args.weight_version is not None:
            versions, version_range = parse_weight_versions(args.weight_version)
        row_filter = RowFilter(
            agents=None if args.agent is None else parse_list(args.agent, "--agent"),
            statuses=None if args.status is None else parse_list(args.status, "--status"),
            min_reward=_number(args.min_reward, "--min-reward"),
            max_reward=_number(args.max_reward, "--max-reward"),
            weight_versions=versions,
            weight_version_range=version_range,
            sample_ids=None if args.sample_ids is None else read_sample_ids(args.sample_ids),
        )
    except ValueError as e:
        raise UsageError(f"filter: {e}") from e
    ds = RolloutDataset.open(args.path)
    if row_filter.agents is not None:
        present = set(ds.scan().select(pl.col("agent").unique()).collect()["agent"].to_list())
        missing = sorted(set(row_filter.agents) - present)
        if missing:
            have = ", ".join(sorted(present)) or "none: the dataset has no rows"
            raise UsageError(f"filter: --agent {missing[0]!r}: no such agent in {args.path} (agents: {have})")
    command = shlex.join([PROG, *(sys.argv[1:] if argv is None else argv)])
    result = filter_dataset(
        ds, args.out, row_filter, command=command, writer_id=args.writer_id, progress=not args.no_progress
    )
    if args.json:
        _print_json(out, result.to_dict())
    else:
        print(f"{PROG} filter: {args.path} -> {args.out}: {result.summary()}", file=out.file)
    return EXIT_OK


def _number(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a number") from None


# -- report ---------------------------------------------------------------------------------


def _report(args, err: Console) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from rollshard.store.inspection import report
    from rollshard.store.inspection.views.figures import MissingPlotting
    from rollshard.store.inspection.views.metrics import MetricsError
    from rollshard.store.inspection.views.mismatch import AuditDatasetError

    try:
        report.check_out(args.out)  # before the page is built, not after
    except ValueError as e:
        raise UsageError(str(e)) from e
    for path, flag in ((args.audit, "--audit"), (args.metrics, "--metrics")):
        if path is not None and "://" not in path and not os.path.isfile(path):
            raise UsageError(f"{flag} {path}: no such file")
    for path in args.paths:  # every byte against the manifests before any figure is drawn from them
        RolloutDataset.open(path).verify()
    columns = (SpinnerColumn(), TextColumn("report: {task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err, disable=args.no_progress or not err.is_terminal, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        try:
            text = report.build(args.paths, audit=args.audit, metrics=args.metrics,
                                step=lambda name: bar.update(task, description=name), warn=_warning)
        except (MissingPlotting, MetricsError) as e:
            raise UsageError(str(e)) from e
        except AuditDatasetError as e:
            raise UsageError(f"--audit {e}") from e
        except DatasetNotFoundError:
            raise  # its message says what is missing and how to make one
        except FileNotFoundError as e:  # the audit file vanished, or an S3 key that does not exist
            flag = {args.audit: "--audit ", args.metrics: "--metrics "}.get(e.filename, "") if e.filename else ""
            raise UsageError(f"{flag}{e.filename or one_line(e)}: no such file") from e
        bar.update(task, description=f"writing {args.out}")
        try:
            report.write(text, args.out)
        except ValueError as e:  # the folder went away while the page was built
            raise UsageError(str(e)) from e
    print(f"{PROG} report: wrote {args.out} ({len(text.encode()) / 1e6:.1f} MB)", file=sys.stderr)
    return EXIT_OK


# -- stats ----------------------------------------------------------------------------------


def _stats(ds: RolloutDataset, args, out: Console, err: Console) -> int:
    from rollshard.store.inspection.stats import dataset_stats

    with err.status("scanning shards...") if err.is_terminal else nullcontext():
        st = dataset_stats(ds)
    if args.json:
        _print_json(out, st)
        return EXIT_OK
    out.print(_totals_table(st))
    out.print(_counts_table("rows by status", "status", st["status"], st["rows"]))
    out.print(_agents_table(st))
    if any(a.get("parse") for a in st["agents"].values()):
        out.print(_parse_table(st))
    return EXIT_OK


def _parse_table(st: dict[str, Any]) -> Table:
    """Each agent's parse rates (an agent system that records answer_status / judgment_status: multi_agent)."""
    t = Table(title="parsed by agent")
    for c in ("agent", "what", "rows", "ok", "statuses"):
        t.add_column(c, justify="left" if c in ("agent", "what", "statuses") else "right")
    for agent, a in st["agents"].items():
        for key, e in a.get("parse", {}).items():
            statuses = ", ".join(f"{k} {n:,}" for k, n in e["counts"].items())
            _row(t, agent, key.removesuffix("_status"), f"{e['rows']:,}", f"{e['ok_share']:.1%}", statuses)
    return t


def _totals_table(st: dict[str, Any]) -> Table:
    t = Table(title=escape(f"dataset {st['dataset']}"), show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value", justify="right")
    for key in ("schema_version", "fingerprint", "writers", "shards", "rows", "groups"):
        _row(t, key, _fmt(st[key]))
    for key in ("prompt_tokens", "response_tokens", "tokens", "bytes"):
        _row(t, key, _fmt(st[key]))
    if st["rows_with_support"]:
        _row(t, "rows with a sampling support", f"{st['rows_with_support']:,} ({st['support_fraction']:.1%})")
    if st["rows_with_routing"]:
        shapes = ", ".join(f"{r['layers']} layers x top-{r['top_k']} of {r['experts']} experts" for r in st["routing"])
        _row(t, "rows with MoE routing", f"{st['rows_with_routing']:,} ({st['rows_with_routing'] / st['rows']:.1%}; "
             f"{shapes})")
    return t


def _counts_table(title: str, name: str, counts: dict[str, int], total: int) -> Table:
    t = Table(title=title)
    t.add_column(name)
    t.add_column("rows", justify="right")
    t.add_column("share", justify="right")
    for k, n in counts.items():
        _row(t, str(k), f"{n:,}", f"{n / total:.1%}" if total else "-")
    return t


def _agents_table(st: dict[str, Any]) -> Table:
    t = Table(title="by agent")
    cols = ("rows", "groups", "response_tokens", "trainable_tokens", "reward_mean", "reward_std")
    t.add_column("agent")
    for c in cols:
        t.add_column(c.replace("_", " "), justify="right")
    for agent, a in st["agents"].items():
        _row(t, agent, *(_fmt(a[c]) for c in cols))
    return t


# -- inspect --------------------------------------------------------------------------------


def _inspect(ds: RolloutDataset, args, out: Console, err: Console) -> int:
    if args.sample is not None:
        return _inspect_sample(ds, args, out, err)
    from rollshard.store.inspection.stats import inspect_summary

    with err.status("scanning shards...") if err.is_terminal else nullcontext():
        summary = inspect_summary(ds)
    if args.json:
        _print_json(out, summary)
        return EXIT_OK
    st = summary["stats"]
    out.print(_totals_table(st))
    if summary["lineage"]:
        out.print(_lineage_table(summary["lineage"]))
    config = Table(title="run config", show_header=False)
    config.add_column("key", style="bold")
    config.add_column("value", overflow="fold")
    shown = {k: v for k, v in summary["config"].items() if k not in (DERIVED_KEY, LINEAGE_KEY)}  # the lineage table's
    for key, value in _flatten(shown):
        _row(config, key, str(value))
    out.print(config)
    writers = Table(title="writers")
    for c in ("writer", "shards", "rows", "groups", "tokens", "bytes"):
        writers.add_column(c, justify="left" if c == "writer" else "right")
    for w in summary["writers"]:
        _row(writers, w["writer_id"], *(_fmt(w[c]) for c in ("shards", "rows", "groups", "tokens", "bytes")))
    out.print(writers)
    out.print(_counts_table("rows by status", "status", st["status"], st["rows"]))
    out.print(_counts_table("rows by finish reason", "finish_reason", summary["finish_reason"], st["rows"]))
    out.print(_agents_table(st))
    rounds = Table(title=f"reward by agent and round (finite rewards; std ddof={REWARD_STD_DDOF})")
    for c in ("agent", "round", "rows", "reward rows", "mean", "std"):
        rounds.add_column(c, justify="left" if c == "agent" else "right")
    for r in summary["reward_by_agent_round"]:
        _row(rounds, r["agent"], *(_fmt(r[c]) for c in ("round", "rows", "reward_rows", "reward_mean", "reward_std")))
    out.print(rounds)
    lengths = Table(title="response length (tokens)")
    for c in ("agent", "rows", "mean", "p50", "p90", "max", "truncated"):
        lengths.add_column(c, justify="left" if c == "agent" else "right")
    for r in summary["response_length"]:
        spread = (_fmt(r[c]) for c in ("p50", "p90", "max"))
        _row(lengths, r["agent"], _fmt(r["rows"]), f"{r['mean']:,.1f}", *spread, f"{r['truncated_frac']:.1%}")
    out.print(lengths)
    zv = summary["zero_variance_groups"]
    zero = Table(title="groups: zero reward variance (2+ rows, equal rewards: no learning signal); single-member "
                 "(1 row: trained on its reward)")
    for c in ("agent", "groups", "zero variance", "fraction", "single-member"):
        zero.add_column(c, justify="left" if c == "agent" else "right")
    for agent, z in zv["by_agent"].items():
        _row(zero, agent, _fmt(z["groups"]), _fmt(z["zero_variance"]), f"{z['fraction']:.1%}", _fmt(z["single_member"]))
    _row(zero, "all", _fmt(zv["groups"]), _fmt(zv["zero_variance"]), f"{zv['fraction']:.1%}" if zv["groups"] else "-",
         _fmt(zv["single_member"]))
    out.print(zero)
    versions = Table(title="rows by weight_version")
    for c in ("weight_version", "rows", "multi-version rows"):
        versions.add_column(c, justify="left" if c == "weight_version" else "right")
    for r in summary["weight_version"]:
        _row(versions, str(r["weight_version"]), _fmt(r["rows"]), _fmt(r["multi_version_rows"]))
    out.print(versions)
    return EXIT_OK


def _lineage_table(lineage: list[dict[str, Any]]) -> Table:
    t = Table(title="lineage (newest first; details: the operation's settings)")
    for c in ("step", "operation", "parent", "parent fingerprint", "details"):
        short = c in ("step", "operation", "parent fingerprint")  # kept whole; the others fold
        t.add_column(c, justify="right" if c == "step" else "left", overflow="fold", no_wrap=short, min_width=None)
    for n, e in enumerate(lineage, 1):
        details = e.get("details")
        if isinstance(details, dict) and isinstance(details.get("expression"), str):
            shown = details["expression"]
        else:
            shown = json.dumps(details, sort_keys=True)
        _row(t, n, e.get("operation"), e.get("parent"), e.get("parent_fingerprint"), shown)
    return t


def _inspect_sample(ds: RolloutDataset, args, out: Console, err: Console) -> int:
    from rollshard.store.inspection.stats import decode_each, find_sample
    from rollshard.store.models.tokenizer import load_tokenizer
    from rollshard.store.inspection.views.paths import dataset_tokenizer

    audit, sources = _audit_tokens(args, ds)
    if args.sample == WORST_MISMATCH:
        if audit is None:
            raise UsageError(f"--sample {WORST_MISMATCH} needs --audit AUDIT.parquet (written by rollshard-train audit)")
        from rollshard.store.inspection.views.mismatch import worst_sample

        worst = worst_sample(audit)
        if worst is None:
            raise UsageError(f"--audit {args.audit}: the audit report has no tokens")
        source, sid = worst
        sources = [source] if sources is not None else None  # the worst token's source, when the report names it
        row = find_sample(ds, sid)
        if row is None:
            raise UsageError(f"--audit {args.audit}: its worst sample {sid!r} is not in {ds.storage.uri} "
                              "(an audit of another dataset?)")
    else:
        row = _pick_sample(ds, args.sample) if args.sample in ("first", "random") else None
        row = row or find_sample(ds, args.sample)
    if row is None:
        first = ds.scan().select("sample_id").head(1).collect()["sample_id"].to_list()
        hint = f"; ids look like {first[0]!r}" if first else "; the dataset has no rows"
        raise UsageError(f"no sample_id {args.sample!r} in {ds.storage.uri}{hint}")
    ids = list(row["response_tokens"])
    path = args.tokenizer or dataset_tokenizer(ds.config, ds.storage.uri)
    texts, decoded_with = None, None
    if path:
        try:
            texts, decoded_with = decode_each(load_tokenizer(path), ids), path
        except (OSError, ValueError) as e:
            if args.tokenizer:
                raise UsageError(f"cannot load a tokenizer from {path}: {one_line(e)}") from e
            note = f"note: showing token ids; the run config's tokenizer {path} did not load: {one_line(e)}"
            print(note, file=sys.stderr)
    tokens = [
        {"pos": i, "id": t, "text": texts[i] if texts else None, "logprob": lp, "mask": m}
        for i, (t, lp, m) in enumerate(zip(ids, row["rollout_logprobs"], row["loss_mask"]))
    ]
    trainer = None
    if audit is not None:  # the trainer's logprob of each audited (trained) token, by position
        from rollshard.store.inspection.views.mismatch import sample_tokens

        got = sample_tokens(audit, row["sample_id"], sources[0] if sources else None)
        trainer = dict(zip(got["position"].to_list(), got["trainer_logprob"].to_list()))
        if not trainer:
            print(f"note: sample {row['sample_id']!r} is not in the audit report {args.audit}", file=sys.stderr)
        for t in tokens:
            tl = trainer.get(t["pos"])
            t["trainer_logprob"] = tl
            t["diff"] = None if tl is None else tl - t["logprob"]
    support = row.get("sampling_support")  # schema 1.1: per token, its sampling logprob and support size
    if support is not None:
        for t, slp, sup in zip(tokens, row["sampling_logprobs"], support):
            t["sampling_logprob"], t["support_size"] = slp, len(sup)
    per_token = ("response_tokens", "rollout_logprobs", "loss_mask", "sampling_logprobs", "sampling_support")
    scalars = {k: v for k, v in row.items() if k not in per_token}
    scalars["prompt_tokens"] = list(row["prompt_tokens"])
    if scalars.get("reward") is not None:  # stored as float32: its shortest decimal, not the float64 widening
        scalars["reward"] = float(str(np.float32(scalars["reward"])))
    if args.json:
        doc = {"sample": scalars, "tokenizer": decoded_with, "tokens": tokens}
        if audit is not None:
            doc["audit"] = _audit_line(tokens)
        _print_json(out, doc)
        return EXIT_OK

    head = Table(title=escape(f"sample {row['sample_id']}"), show_header=False)
    head.add_column("field", style="bold")
    head.add_column("value", overflow="fold")
    for k, v in scalars.items():
        if k == "prompt_tokens":
            v = f"{len(v):,} tokens"
        elif k in ("prompt_text", "response_text") and v and len(v) > 400:
            v = v[:400] + f"... ({len(v):,} characters)"
        _row(head, k, "-" if v is None else _printable(str(v)))
    on = [t["logprob"] for t in tokens if t["mask"] == 1]
    _row(head, "response", f"{len(tokens):,} tokens, {len(on):,} under loss_mask 1")
    if on:
        _row(head, "mean logprob (mask 1)", f"{sum(on) / len(on):.4f}")
    sizes = [t["support_size"] for t in tokens if t["mask"] == 1 and "support_size" in t]
    if support is None:
        _row(head, "sampling support", "none (not truncated, or not recorded)")
    elif sizes:
        _row(head, "sampling support", f"{min(sizes):,}-{max(sizes):,} ids per token (mask 1)")
    if audit is not None:
        a = _audit_line(tokens)
        shown = (f"{a['tokens']:,} tokens audited; |trainer - rollout| mean {a['abs_diff_mean']:.4g}, max "
                 f"{a['abs_diff_max']:.4g} at position {a['worst_position']}") if a["tokens"] else "not in the report"
        _row(head, "audit", shown)
    out.print(head)
    limit = args.max_tokens if args.max_tokens > 0 else len(tokens)
    source = f"decoded with {decoded_with}" if decoded_with else "ids; no tokenizer"
    tt = Table(title=escape(f"response tokens ({source})"))
    columns = ("pos", "id", "text", "logprob", "mask") + (("sampling logprob", "support") if support is not None else ())
    columns += ("trainer logprob", "diff") if trainer is not None else ()
    for c in columns:
        tt.add_column(c, justify="left" if c == "text" else "right")
    for t in tokens[:limit]:
        style = "dim" if t["mask"] == 0 else None
        text = repr(t["text"])[1:-1] if t["text"] is not None else ""
        extra = (f"{t['sampling_logprob']:.4f}", t["support_size"]) if support is not None else ()
        if trainer is not None:
            tl = t["trainer_logprob"]
            extra += ("-", "-") if tl is None else (f"{tl:.4f}", _diff_cell(t["diff"]))
        _row(tt, t["pos"], t["id"], text, _logprob_cell(t["logprob"], t["mask"]), t["mask"], *extra, style=style)
    out.print(tt)
    if limit < len(tokens):
        out.print(f"... {len(tokens) - limit:,} more tokens (--max-tokens 0 shows all)")
    return EXIT_OK


WORST_MISMATCH = "worst-mismatch"
DIFF_WARN = 0.1  # |trainer - rollout| above it: a ratio outside about [0.9, 1.1], where a PPO clip of 0.1 acts


def _audit_tokens(args, ds: RolloutDataset):
    """The tokens of ``--audit`` that are of ``ds`` and the report's sources that are ``ds`` (None, None without
    --audit; the whole report and None for a report naming no dataset, with a warning); a bad file, or an audit
    of another dataset, is a one-line usage error."""
    if args.audit is None:
        return None, None
    from rollshard.store.inspection.views.mismatch import UNPAIRED, AuditDatasetError, load, pair

    if "://" not in args.audit and not os.path.isfile(args.audit):
        raise UsageError(f"--audit {args.audit}: no such file")
    report = load(args.audit)
    try:
        pairing = pair(report, [ds], audit=args.audit)
    except AuditDatasetError as e:
        raise UsageError(f"--audit {e}") from e
    if pairing.audited is None:
        _warning(f"--audit {args.audit} {UNPAIRED}")
        return report, None
    return pairing.tokens(report), pairing.sources_of(ds)


def _audit_line(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    diffs = [(abs(t["diff"]), t["pos"]) for t in tokens if t.get("diff") is not None]
    worst = max(diffs, default=(None, None))
    return {"tokens": len(diffs), "abs_diff_mean": sum(d for d, _ in diffs) / len(diffs) if diffs else None,
            "abs_diff_max": worst[0], "worst_position": worst[1]}


def _diff_cell(diff: float) -> Text:
    return Text(f"{diff:+.4f}", style="red" if abs(diff) > DIFF_WARN else None)


def _pick_sample(ds: RolloutDataset, which: str) -> dict[str, Any] | None:
    """The first row of the dataset, or one drawn at random (None when it has no rows)."""
    import random

    lf = ds.scan()
    if which == "first":
        df = lf.head(1).collect()
    else:
        n = lf.select(pl.len()).collect().item()
        df = lf.slice(random.randrange(n), 1).collect() if n else lf.head(0).collect()
    return df.row(0, named=True) if df.height else None


_CONTROL = {c: f"\\x{c:02x}" for c in range(32) if chr(c) not in "\n\t"} | {127: "\\x7f"}


def _printable(text: str) -> str:
    """``text`` with control characters (model output can hold terminal escapes) shown as ``\\xNN``."""
    return text.translate(_CONTROL)


def _logprob_cell(lp: float, mask: int) -> Text:
    if mask == 0:
        return Text(f"{lp:.4f}")
    color = "green" if lp > -0.5 else "yellow" if lp > -2.5 else "red"  # p > 0.61, p > 0.08, rarer
    return Text(f"{lp:.4f}", style=color)


# -- helpers --------------------------------------------------------------------------------


def _row(table: Table, *cells: Any, style: str | None = None) -> None:
    """Add a row of data: strings are shown as they are, never parsed as rich markup."""
    table.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in cells), style=style)


def _error(message: str) -> None:
    """One unwrapped line on stderr (rich would wrap it at the terminal width)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)


def _warning(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def _print_json(out: Console, doc: Any) -> None:
    out.file.write(json.dumps(doc, indent=1, default=str) + "\n")
    out.file.flush()


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4f}" if abs(v) < 1e6 else f"{v:,.0f}"
    return str(v)


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict) and d:
        return [kv for k, v in d.items() for kv in _flatten(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), d)] if prefix else []




if __name__ == "__main__":
    sys.exit(main())

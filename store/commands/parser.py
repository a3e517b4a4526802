"""``rollshard-store``'s command line: one subcommand per job, each flag with its help."""

from __future__ import annotations

import argparse

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

"""Rescore benchmark: ``rollshard-generate rescore`` vs the script a user would write instead, in one run.

    .venv/bin/python tests/bench/bench_rescore.py [--groups 250] [--group-size 8] [--repeat 3] [--json]

The data: synthetic rows with realistic shapes (store/synthetic.py: prompts 200-1,000 tokens,
responses 100-4,000), one shard. The reward: the toy task's verifier (digit fraction of the
response text), a cheap pure-Python function, so the figures are the pipeline's cost.

* ``rescore``: :func:`rescore_table` through :func:`derive_dataset` (rows rebuilt per episode,
  the agent system's rule, every other column checked bit for bit against the parent, the
  writer's invariants, sha256, an atomic commit and lineage);
* ``bare``: ``pyarrow.parquet.read_table``, a Python loop over ``response_text``, ``set_column``,
  ``pyarrow.parquet.write_table`` (no checks, no lineage, not resumable).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rollshard.generate.agents import make_agent_system
from rollshard.generate.rescore import rescore_table
from rollshard.generate.rewards import TaskScorer
from rollshard.generate.tasks import get_task
from rollshard.generate.tasks.toy import toy_verify
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.derived.derive import derive_dataset
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter

from bench_store import best_of  # this folder is on the path when a bench runs as a script


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=250)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="rollshard-bench-rescore-"))
    try:
        table = synthetic_table(args.groups, args.group_size)
        parent = root / "parent"
        with ShardWriter(parent, writer_id="gen-0-of-1", config={"agents": {"name": "single"}, "task": "toy"}) as w:
            w.write_groups(table)
        ds = RolloutDataset.open(parent)
        rows, tokens = ds.num_rows, ds.num_tokens
        system, scorer = make_agent_system("single"), TaskScorer(get_task("toy"))

        def rescore() -> None:
            out = root / "rescored"
            shutil.rmtree(out, ignore_errors=True)
            with asyncio.Runner() as loop:
                derive_dataset(
                    parent, out, lambda t: loop.run(rescore_table(t, system, scorer)), operation="rescore",
                    details={"reward": scorer.identity}, mutable_columns=("reward", "metadata"), progress=False,
                )

        def bare() -> None:
            t = pq.read_table(ds.files[0])
            reward = pa.array([toy_verify(text or "", None).reward for text in t.column("response_text").to_pylist()],
                              pa.float32())
            t = t.set_column(t.schema.get_field_index("reward"), "reward", reward)
            pq.write_table(t, root / "bare.parquet", compression="zstd", compression_level=1)

        seconds = {"rescore": best_of(args.repeat, rescore), "bare": best_of(args.repeat, bare)}
        out = {
            "rows": rows,
            "tokens": tokens,
            "bytes": ds.num_bytes,
            **{f"{k}_rows_per_s": rows / v for k, v in seconds.items()},
            **{f"{k}_s": v for k, v in seconds.items()},
            "rescore_vs_bare": seconds["bare"] / seconds["rescore"],
        }
        if args.json:
            print(json.dumps(out))
            return
        print(f"{rows:,} rows, {tokens:,} tokens, {ds.num_bytes / 2**20:.0f} MiB on disk\n")
        print("| path | s | rows/s | vs bare |\n|---|---:|---:|---:|")
        for k, v in seconds.items():
            print(f"| {k} | {v:.2f} | {rows / v:,.0f} | {seconds['bare'] / v:.2f}x |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

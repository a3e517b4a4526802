"""Benchmark: one generate job three ways over the same two ``rollshard-generate serve`` processes (tiny GPT-2 on
CPU, 127.0.0.1): one process with both URLs; ``--ray`` with 2 tasks (a one-machine Ray cluster the command starts);
one process through the real sglang-router in front of both (its default
cache_aware policy, and round_robin).

Each run is the command as a user runs it, in a fresh subprocess into a fresh dataset. Two figures per run: the
wall time (process start to exit: Python and model-info start-up, for Ray also the cluster's start and its
workers' imports) and the generation time the command itself reports (for Ray, the slowest task's). rows/s and
response tokens/s are over each. On a 2-core machine the servers, the tasks and the router share the cores, so
this measures the orchestration's cost, not a speed-up; every run samples the same prompts (same sample ids).

    .venv/bin/python tests/bench/bench_cluster.py [--prompts 16] [--n-samples 4] [--max-new-tokens 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from rollshard.generate.models import init_model  # noqa: E402
from rollshard.store.io.dataset import RolloutDataset  # noqa: E402
from tests.generate.conftest import start_embedded_server, start_router, stop_server  # noqa: E402

DONE = re.compile(r"prompts done in ([\d.]+) s")


def run_job(name: str, engine_args: list[str], job: list[str], out: Path, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "rollshard.generate", *job, *engine_args, "--out", str(out)]  # engine_args last: win
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    generate_s = max(float(s) for s in DONE.findall(proc.stderr))
    ds = RolloutDataset.open(out)
    rows, tokens = sum(s.rows for s in ds.shards), sum(s.response_tokens for s in ds.shards)
    ids = sorted(ds.read(columns=["sample_id"]).column("sample_id").to_pylist())
    return {
        "run": name, "rows": rows, "response_tokens": tokens, "wall_s": round(wall, 2),
        "generate_s": round(generate_s, 2), "rows_per_s_wall": round(rows / wall, 2),
        "tokens_per_s_wall": round(tokens / wall, 1), "rows_per_s_generate": round(rows / generate_s, 2),
        "tokens_per_s_generate": round(tokens / generate_s, 1), "_ids": ids,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16, help="toy prompts (16 in the task)")
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (each of 2 Ray tasks: half)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest (by generation time) is kept")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rs-bench-", dir="/tmp"))  # short: Ray's socket paths are limited
    env = {**os.environ, "RAY_TMPDIR": str(work), "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    model = init_model(work / "tiny-gpt2", preset="tiny-gpt2", seed=0)
    job = [
        "--agents", "single", "--task", "toy", "--n-samples", str(args.n_samples), "--max-new-tokens",
        str(args.max_new_tokens), "--limit", str(args.prompts), "--concurrency", str(args.concurrency), "--no-progress",
    ]  # fmt: skip
    servers = [start_embedded_server(model) for _ in range(2)]
    urls = [url for _, url in servers]
    routers = {
        policy: start_router(urls, work / f"router-{policy}.log", "--policy", policy)
        for policy in ("cache_aware", "round_robin")  # cache_aware: the router's default
    }
    # Ray: each task keeps half the requests in flight, so every run has --concurrency in flight in all.
    per_task = ["--concurrency", str(max(1, args.concurrency // 2))]
    runs = {
        "one process, 2 URLs": ["--engine", ",".join(urls)],
        "ray, 2 tasks": ["--ray", "--num-shards", "2", "--engine", ",".join(urls), *per_task],
        **{f"router, {policy}": ["--engine", url] for policy, (_, url) in routers.items()},
    }
    try:
        # Warm-up (discarded): the servers' first forwards pay torch's start-up, which would go to the first run.
        run_job("warm-up", ["--engine", ",".join(urls)], [*job, "--limit", "2"], work / "warm-up", env)
        best: dict[str, dict] = {}
        for r in range(args.repeat):  # interleaved, so a busy spell of the machine hits every kind of run
            for name, engine_args in runs.items():
                f = run_job(name, engine_args, job, work / f"{len(best)}-{r}-{abs(hash(name))}", env)
                if name not in best or f["generate_s"] < best[name]["generate_s"]:
                    best[name] = f
        figures = list(best.values())
    finally:
        for proc, _ in routers.values():
            stop_server(proc)
        for proc, _ in servers:
            stop_server(proc)
        shutil.rmtree(work, ignore_errors=True)
    same = all(f["_ids"] == figures[0]["_ids"] for f in figures)
    for f in figures:
        del f["_ids"]
    if args.json:
        print(json.dumps({"runs": figures, "same_sample_ids": same}))
        return
    print(f"{'run':<22} {'rows':>5} {'tokens':>7} {'wall s':>7} {'rows/s':>7} {'tok/s':>7} {'gen s':>6} {'rows/s':>7} {'tok/s':>7}")
    for f in figures:
        print(
            f"{f['run']:<22} {f['rows']:>5} {f['response_tokens']:>7} {f['wall_s']:>7} {f['rows_per_s_wall']:>7} "
            f"{f['tokens_per_s_wall']:>7} {f['generate_s']:>6} {f['rows_per_s_generate']:>7} {f['tokens_per_s_generate']:>7}"
        )
    print(f"same sample ids in every run: {same} (best of {args.repeat} by generation time)")


if __name__ == "__main__":
    main()

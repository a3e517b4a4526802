"""The loop's stages forked from its warm server against a process per stage (``--fresh-stages``).

    .venv/bin/python tests/bench/bench_loop_stages.py [--rounds 3] [--repeats 2] [--async-steps 24] [--json]

The README's toy loop (tiny random GPT-2, ``--task toy --n-samples 16 --max-new-tokens 16``, 2 groups a step, 3
epochs) run both ways, alternating, ``--repeats`` times each; then the README's ``--async`` run both ways. Per run:
the wall time of the whole command and, for the rounds, each stage's seconds as ``loop.json`` records them. The
ratio is the fresh runs' median wall time over the forked ones'. Markdown on stdout, or ``--json``: one object.
Each run is a process of its own (``--no-report``: the report's cost is the same both ways).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
GENERATE = "--task toy --n-samples 16 --max-new-tokens 16"


def log(msg: str) -> None:
    print(f"[bench_loop_stages] {msg}", file=sys.stderr, flush=True)


def run(command: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--async-steps", type=int, default=24)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_loop_stages-"))
    model = work / "tiny"
    subprocess.run([PY, "-m", "rollshard.generate", "init-model", "--preset", "tiny", str(model)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    runs: dict[str, list[dict]] = {"forked": [], "fresh": []}
    for i in range(args.repeats):
        for mode in ("forked", "fresh"):
            out = work / f"rounds-{mode}-{i}"
            command = [PY, "-m", "rollshard.train.loop", "--model", str(model), "--out", str(out), "--rounds",
                       str(args.rounds), "--generate", GENERATE, "--train",
                       "--groups-per-step 2 --num-epochs 3 --lr 5e-3 --mode decoupled", "--no-report",
                       "--no-progress", *(["--fresh-stages"] if mode == "fresh" else [])]  # fmt: skip
            wall = run(command)
            rounds = json.loads((out / "loop.json").read_text())["rounds"]
            stages = [r["seconds"] for r in rounds]
            runs[mode].append({"wall_s": round(wall, 2), "stages_s": stages})
            log(f"rounds {mode} #{i}: {wall:.1f} s, stages {stages}")
    asyncs: dict[str, float] = {}
    for mode in ("forked", "fresh"):
        out = work / f"async-{mode}"
        command = [PY, "-m", "rollshard.train.loop", "--async", "--model", str(model), "--out", str(out),
                   "--steps", str(args.async_steps), "--max-staleness", "1", "--generate", GENERATE, "--train",
                   "--groups-per-step 2 --lr 5e-3 --mode decoupled", "--no-report", "--no-progress",
                   *(["--fresh-stages"] if mode == "fresh" else [])]  # fmt: skip
        asyncs[mode] = round(run(command), 2)
        log(f"async {mode}: {asyncs[mode]:.1f} s")
    median = {mode: statistics.median(r["wall_s"] for r in rs) for mode, rs in runs.items()}
    result = {
        "rounds": args.rounds, "repeats": args.repeats, "runs": runs, "median_wall_s": median,
        "ratio_fresh_over_forked": round(median["fresh"] / median["forked"], 2),
        "async_steps": args.async_steps, "async_wall_s": asyncs,
        "async_ratio_fresh_over_forked": round(asyncs["fresh"] / asyncs["forked"], 2),
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print("| loop | forked stages | a process per stage (`--fresh-stages`) | ratio |\n|---|---|---|---|")
    print(f"| {args.rounds} rounds, median of {args.repeats} | {median['forked']:.1f} s | {median['fresh']:.1f} s | "
          f"{result['ratio_fresh_over_forked']:.2f}x |")
    print(f"| --async, {args.async_steps} steps | {asyncs['forked']:.1f} s | {asyncs['fresh']:.1f} s | "
          f"{result['async_ratio_fresh_over_forked']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

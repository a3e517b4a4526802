"""The asynchronous loop against synchronous rounds: the same optimizer steps on the same task, wall time and reward.

    .venv/bin/python tests/bench/bench_async_loop.py [--model tiny|smollm2] [--steps 24] [--rounds 3]
        [--variants 1:0,2:0,1:1] [--repeats 1] [--out DIR] [--json]

Both sides train ``--steps`` optimizer steps of ``--groups-per-step`` groups, each group once, on the same
prompts (the first ``--prompts`` of the task's train split, cycled with fresh seeds):

* sync: ``rollshard-loop --rounds R`` with ``--num-epochs 1``: each round generates ``--prompts`` groups with the
  round's policy (embedded engine, its default threads) and then trains ``prompts / groups-per-step`` steps
  on them (the trainer with every core); the engine idles while the trainer trains and the other way round.
* async: ``rollshard-loop --async --max-staleness ETA --steps N`` (a ``serve`` engine on one torch thread, the
  trainer on every core by default or ``--train-threads``, weights pushed every step): one run per ``--variants``
  entry ETA:TRAIN_THREADS.

Per run: wall seconds, optimizer steps per hour, the engine's and the trainer's busy shares (sync: each stage's
share of the wall time, from ``loop.json``; async: the engine's own busy seconds, the trainer's step time less
its waits for data), the reward per step (the mean reward of the rows each step trained on) and its mean over
the last third of the steps. The ratio is each async run's steps/hour over the sync runs' mean. Markdown on
stdout, or ``--json``: one object. Each run is a process of its own, one after the other.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
PRESETS = {  # task flags and trainer flags per model
    "tiny": dict(generate="--task toy --n-samples 16 --max-new-tokens 16", train="--lr 5e-3 --mode decoupled",
                 groups_per_step=2, prompts=16),
    "smollm2": dict(generate="--task arithmetic --n-samples 8 --max-new-tokens 48 --temperature 0.6",
                    train="--lr 2e-5 --mode decoupled --micro-batch-tokens 2048", groups_per_step=4, prompts=16),
}


def log(msg: str) -> None:
    print(f"[bench_async_loop] {msg}", file=sys.stderr, flush=True)


def model_folder(name: str, work: Path) -> Path:
    path = work / name
    if not path.exists():
        preset = "tiny" if name == "tiny" else "smollm2-135m-instruct"
        subprocess.run([PY, "-m", "rollshard.generate", "init-model", "--preset", preset, str(path)], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def metrics_rewards(train_dirs: list[Path]) -> list[float]:
    out = []
    for d in train_dirs:
        for line in (d / "metrics.jsonl").read_text().splitlines():
            if line.strip():
                out.append(json.loads(line).get("reward/mean"))
    return out


def run_sync(model: Path, out: Path, p: dict, rounds: int, seed: int) -> dict:
    cmd = [PY, "-m", "rollshard.train.loop", "--model", str(model), "--out", str(out), "--rounds", str(rounds),
           "--seed", str(seed), "--no-report", "--no-progress", "--json",
           "--generate", f"{p['generate']} --limit {p['prompts']}",
           "--train", f"{p['train']} --groups-per-step {p['groups_per_step']} --num-epochs 1 --no-tensorboard"]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    state = json.loads((out / "loop.json").read_text())
    gen = sum(r["seconds"]["generate"] for r in state["rounds"])
    train = sum(r["seconds"]["train"] for r in state["rounds"])
    rewards = metrics_rewards([out / f"round_{k:03d}" / "train" for k in range(rounds)])
    drop_weights(out)
    return figures("sync", None, seed, seconds, rewards, gen / seconds, train / seconds)


def run_async(model: Path, out: Path, p: dict, steps: int, eta: int, seed: int, threads: int) -> dict:
    cmd = [PY, "-m", "rollshard.train.loop", "--async", "--model", str(model), "--out", str(out),
           "--train-threads", str(threads),
           "--steps", str(steps), "--max-staleness", str(eta), "--seed", str(seed), "--no-progress", "--json", "--no-report",
           "--generate", f"{p['generate']} --limit {p['prompts']}",
           "--train", f"{p['train']} --groups-per-step {p['groups_per_step']} --no-tensorboard"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    f = json.loads(done.stdout)["async"]
    drop_weights(out)
    return figures("async", eta, seed, seconds, f["reward_by_step"], f.get("engine_busy_share"),
                   f["trainer_busy_share"], staleness=f["staleness_hist"], dropped=f["rows_dropped_stale"],
                   train_threads=threads)


def drop_weights(out: Path) -> None:
    """The run's checkpoints and exports (GBs for SmolLM2): its figures are read, its weights are not needed."""
    for folder in [*out.glob("train/checkpoints"), *out.glob("train/policy"), *out.glob("round_*/train/checkpoints")]:
        shutil.rmtree(folder)


def figures(mode, eta, seed, seconds, rewards, engine_busy, trainer_busy, **extra) -> dict:
    third = [r for r in rewards[-max(1, len(rewards) // 3):] if r is not None]
    return {"mode": mode, "eta": eta, "seed": seed, "seconds": round(seconds, 1), "steps": len(rewards),
            "steps_per_hour": round(len(rewards) / seconds * 3600, 1),
            "engine_busy": None if engine_busy is None else round(engine_busy, 3),
            "trainer_busy": round(trainer_busy, 3), "reward_last_third": round(statistics.fmean(third), 4),
            "reward_by_step": [None if r is None else round(r, 4) for r in rewards], **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--rounds", type=int, default=3, help="sync rounds (steps = rounds x prompts / groups-per-step)")
    ap.add_argument("--variants", default="1:0,2:0,1:1",
                    help="async runs as ETA:TRAIN_THREADS (0: the trainer's default, every core)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each side (seeds 0, 1, ...)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    p = PRESETS[args.model]
    steps = args.rounds * p["prompts"] // p["groups_per_step"]
    work = args.out or Path(tempfile.mkdtemp(prefix="bench_async_"))
    model = model_folder(args.model, work)
    runs = []
    for seed in range(args.repeats):
        log(f"sync, seed {seed}: {args.rounds} rounds, {steps} steps")
        runs.append(run_sync(model, work / f"sync_{seed}", p, args.rounds, seed))
        for variant in args.variants.split(","):
            eta, threads = map(int, variant.split(":"))
            log(f"async eta {eta}, trainer threads {threads or 'all'}, seed {seed}: {steps} steps")
            runs.append(run_async(model, work / f"async_{eta}_{threads}_{seed}", p, steps, eta, seed, threads))
    sync = statistics.fmean(r["steps_per_hour"] for r in runs if r["mode"] == "sync")
    for r in runs:
        r["speedup"] = round(r["steps_per_hour"] / sync, 2)
    result = {"model": args.model, "steps": steps, "preset": p, "runs": runs}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print("| side | seed | seconds | steps/hour | speedup | engine busy | trainer busy | reward, last third |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        threads = f", trainer {r['train_threads']} thread" if r.get("train_threads") else ""
        side = "sync rounds" if r["mode"] == "sync" else f"async, eta {r['eta']}{threads}"
        eb = "-" if r["engine_busy"] is None else f"{r['engine_busy']:.0%}"
        print(f"| {side} | {r['seed']} | {r['seconds']:.0f} | {r['steps_per_hour']:.0f} | {r['speedup']:.2f}x | {eb} "
              f"| {r['trainer_busy']:.0%} | {r['reward_last_third']:.3f} |")


if __name__ == "__main__":
    main()

"""Megatron backend benchmark: trainer tokens/s of ``--backend megatron`` against ``--backend hf``, same model,
same batches, CPU.

    .venv/bin/python tests/bench/bench_megatron.py [--size tiny|small] [--prompts 32] [--n-samples 8]
                                                   [--max-new-tokens 64] [--steps 20] [--tp 1,2] [--threads 1] [--json]

Data: the embedded engine samples the toy task with a Qwen3-architecture model (``tiny``: the tiny-qwen3
preset, 64 hidden x 2 layers; ``small``: 256 hidden x 4 layers, 8 heads / 4 key-value heads, same tokenizer,
random weights). Then the trainer runs ``--steps`` GRPO steps (decoupled, one mini-batch) over the same
dataset, loader settings and shuffle seed with each backend: hf in one process, megatron in one process
(``tp 1``) and under torchrun with ``--tp 2`` (2 processes, gloo). Every process gets ``--threads``
intra-op threads (default 1: the tiny models' ops gain nothing from more, and two spinning OpenMP threads per
process on a 2-core machine slow a step down, tests/train/conftest.py); the tp 2 run then uses two cores
where the one-process runs use one. tokens/s = trained tokens / step time over the steps after the first
(start-up, model build and the first step's allocations excluded). Both backends compute in fp32 on CPU;
hf attends with rollshard_varlen (each sequence alone), megatron's local spec with a dense block-diagonal
``[T, T]`` mask.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def build_model(root: Path, size: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollshard.generate.models import init_model

    tiny = init_model(root / "tiny-qwen3", preset="tiny-qwen3", seed=0)
    if size == "tiny":
        return tiny
    cfg = AutoConfig.from_pretrained(tiny)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 256, 768, 4
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 8, 4, 32
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out = root / size
    model.save_pretrained(out)
    for f in tiny.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def sample(model: Path, out: Path, args) -> Path:
    from rollshard.generate.run import main as generate_main

    argv = ["--engine", f"embedded:{model}", "--agents", "single", "--task", "toy", "--n-samples", str(args.n_samples),
            "--limit", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens), "--out", str(out),
            "--seed", "0", "--no-progress"]  # fmt: skip
    assert generate_main(argv) == 0
    return out


def measure(backend: str, tp: int, data: str, model: str, out: str, steps: int, groups: int) -> dict | None:
    """Train ``steps`` steps; the figures on global rank 0 (None elsewhere)."""
    from rollshard.train.backends import close_env, parallel_env
    from rollshard.train.backends.distributed import close_distributed, init_distributed
    from rollshard.train.config import TrainConfig
    from rollshard.train.trainer import Trainer

    config = TrainConfig.from_dict({
        "data": {"path": data, "groups_per_step": groups, "micro_batch_tokens": 2048, "num_epochs": None},
        "model": {"path": model, "backend": backend, "tp": tp},
        "optim": {"lr": 1e-4},
        "loss": {"mode": "decoupled"},
        "trainer": {"out": out, "max_steps": steps, "save_every": 0, "progress": False, "tensorboard": False},
    }).validate()
    env = parallel_env(config, init_distributed())
    trainer = Trainer(config, env=env)
    trainer.save = lambda: None  # the benchmark times training, not the final checkpoint
    try:
        history = trainer.run()
    finally:
        trainer.close()
        close_env(env)
        close_distributed(env)
    if not env.is_main:
        return None
    timed = history[1:]
    tokens, seconds = sum(m["data/tokens"] for m in timed), sum(m["perf/step_s"] for m in timed)
    return {"backend": backend, "tp": tp, "processes": tp if backend == "megatron" else 1, "steps": len(timed),
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "step0_mismatch_max": history[0]["mismatch/abs_diff_max"]}


def worker(argv: list[str]) -> None:
    backend, tp, data, model, out, steps, groups, report = argv
    r = measure(backend, int(tp), data, model, out, int(steps), int(groups))
    if r is not None:
        Path(report).write_text(json.dumps(r))


def run(backend: str, tp: int, data: Path, model: Path, root: Path, args) -> dict:
    procs = tp if backend == "megatron" else 1
    threads = args.threads
    report = root / f"report-{backend}-{tp}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)] if procs > 1 else [sys.executable]
    cmd += [__file__, "--worker", backend, str(tp), str(data), str(model), str(root / f"out-{backend}-{tp}"),
            str(args.steps), str(args.groups_per_step), str(report)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(threads)), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{backend} tp={tp} failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(report.read_text()), "threads_per_process": threads}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tp", default="1,2", help="megatron tensor-parallel sizes to run (comma-separated)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every process")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of a table")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root, args.size)
        data = sample(model, root / "data", args)
        results = [run("hf", 1, data, model, root, args)]
        results += [run("megatron", int(tp), data, model, root, args) for tp in args.tp.split(",")]
    base = results[0]["tokens_per_s"]
    for r in results:
        r["vs_hf"] = r["tokens_per_s"] / base
    if args.json:
        print(json.dumps({"size": args.size, "cpus": os.cpu_count(), "results": results}))
        return
    print(f"| backend | processes | threads each | tokens/s | vs hf | step-0 max mismatch |  ({args.size} model)")
    print("|---|---|---|---|---|---|")
    for r in results:
        name = r["backend"] + (f" --tp {r['tp']}" if r["backend"] == "megatron" else "")
        print(f"| {name} | {r['processes']} | {r['threads_per_process']} | {r['tokens_per_s']:,.0f} | "
              f"{r['vs_hf']:.2f}x | {r['step0_mismatch_max']:.1e} |")


if __name__ == "__main__":
    main()

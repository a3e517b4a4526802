"""Trainer benchmark: step time vs a bare torch loop, packing, data wait, step-0 logprob agreement.

    .venv/bin/python tests/bench/bench_train.py [--sizes tiny,small] [--prompts 16] [--n-samples 8]
                                                [--max-new-tokens 128] [--steps 8] [--repeat 3] [--threads N] [--json]

Data: the embedded engine samples the toy task with a tiny GPT-2 model (random
weights, local tokenizer), so the rollout logprobs are an engine's, not the trainer's.
Per model size (``tiny``: the test model, 64 hidden x 2 layers; ``small``: 256 x 4,
same tokenizer, random weights; each samples its own data):

1. Overhead: the trainer's step (advantages, packed logprobs, loss and its metrics,
   backward per micro-batch, AdamW) against a bare loop over the same packed
   micro-batches: ``model(input_ids, position_ids).logits`` -> fp32 log softmax ->
   gather -> ``-(A * logp).sum() / n`` -> backward, then AdamW. Both on the same
   pre-read steps (no data loading), best of ``--repeat`` passes; target <= 10%. The bare
   loop runs twice: on ``sdpa`` (what a plain loop gets: transformers' dense block-diagonal
   mask of the packed row) and on the trainer's own kernel (``rollshard_varlen``); the
   overhead is against the latter, the speed-up against the former.
2. The trainer over the real loader: tokens/s, packing efficiency, data wait share.
3. Step 0 with unchanged weights: max and mean |logp - rollout_logp|, ratio, clip
   fraction (targets: <= 1e-5 fp32 CPU, 1, 0).

Prints markdown tables for the README's Performance section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.train.attention import VARLEN
from rollshard.train.config import TrainConfig
from rollshard.train.trainer import Trainer

SIZES = {"tiny": None, "small": {"n_embd": 256, "n_layer": 4, "n_head": 4}}


def build_models(root: Path, sizes: list[str]) -> dict[str, Path]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollshard.generate.models import init_model

    tiny = init_model(root / "tiny", preset="tiny-gpt2", seed=0)
    out = {}
    for size in sizes:
        if SIZES[size] is None:
            out[size] = tiny
            continue
        cfg = AutoConfig.from_pretrained(tiny)
        for k, v in SIZES[size].items():
            setattr(cfg, k, v)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        path = root / size
        model.save_pretrained(path)
        for f in tiny.iterdir():  # tokenizer, chat template, generation config
            if f.suffix != ".safetensors" and f.name != "config.json":
                (path / f.name).write_bytes(f.read_bytes())
        out[size] = path
    return out


def generate(model: Path, out: Path, args) -> None:
    from rollshard.generate.run import main as generate_main

    argv = [
        "--engine", f"embedded:{model}", "--agents", "single", "--task", "toy", "--n-samples", str(args.n_samples),
        "--max-new-tokens", str(args.max_new_tokens), "--limit", str(args.prompts), "--out", str(out), "--no-progress",
    ]  # fmt: skip
    assert generate_main(argv) == 0


def train_config(data: Path, model: Path, out: Path, args, **trainer) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "data": {"path": str(data), "groups_per_step": args.groups_per_step,
                     "micro_batch_tokens": args.micro_batch_tokens, "num_epochs": None},
            "model": {"path": str(model)},
            "optim": {"lr": 1e-5},
            "trainer": {"out": str(out), "max_steps": args.steps, "progress": False, "tensorboard": False, **trainer},
        }
    ).validate()


class ListLoader:
    """Pre-read steps, replayed: the trainer's loop without data loading."""

    def __init__(self, steps):
        self.steps = steps

    def __iter__(self):
        return iter(self.steps)

    def set_current_version(self, version) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state) -> None:
        pass


def read_steps(data: Path, args) -> list:
    cfg = LoaderConfig(groups_per_step=args.groups_per_step, micro_batch_tokens=args.micro_batch_tokens, num_epochs=None)
    with RolloutLoader(data, cfg) as loader:
        it = iter(loader)
        return [next(it) for _ in range(args.steps)]


def bare_pass(model, optimizer, steps) -> float:
    """Seconds for a minimal GRPO-shaped forward/backward/AdamW over the steps."""
    t0 = time.perf_counter()
    for step in steps:
        n = sum(float(mb.loss_mask.sum()) for mb in step.micro_batches)
        for mb in step.micro_batches:
            logits = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False).logits[0]
            logp = torch.log_softmax(logits[:-1].float() / mb.temperature[1:, None], dim=-1)
            logp = logp.gather(-1, mb.input_ids[1:, None])[:, 0]  # [T-1]: logits at t-1 score token t
            adv = torch.repeat_interleave(mb.rewards - mb.rewards.mean(), (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long())
            loss = -(adv[1:] * logp * mb.loss_mask[1:]).sum() / n
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def trainer_pass(config: TrainConfig, steps, run: int) -> tuple[float, list[dict]]:
    cfg = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, out=f"{config.trainer.out}-{run}"))
    trainer = Trainer(cfg, loader=ListLoader(steps))
    trainer.save = lambda: None  # checkpoint writing is not part of a step
    t0 = time.perf_counter()
    history = trainer.run()
    elapsed = time.perf_counter() - t0
    trainer.close()
    return elapsed, history


def bench_size(size: str, model: Path, root: Path, args) -> dict:
    from transformers import AutoModelForCausalLM

    data = root / f"data-{size}"
    t0 = time.perf_counter()
    generate(model, data, args)
    gen_s = time.perf_counter() - t0
    steps = read_steps(data, args)
    tokens = sum(s.num_tokens for s in steps)

    bare_by_attention = {}
    for attention in ("sdpa", VARLEN):  # what a plain loop gets (a dense packed mask), and the trainer's kernel
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation=attention).eval()
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)
        bare_pass(hf, opt, steps[:1])  # warm up
        bare_by_attention[attention] = min(bare_pass(hf, opt, steps) for _ in range(args.repeat))
    bare, bare_varlen = bare_by_attention["sdpa"], bare_by_attention[VARLEN]

    config = train_config(data, model, root / f"run-{size}", args)
    trainer_pass(config, steps[:1], -1)  # warm up
    runs = [trainer_pass(config, steps, r) for r in range(args.repeat)]
    ours = min(t for t, _ in runs)

    real = Trainer(train_config(data, model, root / f"real-{size}", args))
    history = real.run()
    real.close()
    m0 = history[0]
    later = history[1:] or history
    return {
        "size": size,
        "params": sum(p.numel() for p in hf.parameters()),
        "rows/step": steps[0].num_sequences,
        "tokens/step": tokens / len(steps),
        "micro/step": statistics.mean(len(s.micro_batches) for s in steps),
        "gen_s": gen_s,
        "bare_ms": 1e3 * bare / len(steps),
        "bare_varlen_ms": 1e3 * bare_varlen / len(steps),
        "trainer_ms": 1e3 * ours / len(steps),
        "overhead": ours / bare_varlen - 1,  # against the same attention kernel
        "speedup_vs_sdpa_loop": bare / ours,
        "tok_s": statistics.mean(h["perf/tokens_per_s"] for h in later),
        "packing": statistics.mean(h["loader/packing_efficiency"] for h in history),
        "wait": statistics.mean(h["perf/data_wait_share"] for h in later),
        "wait_first": m0["perf/data_wait_share"],
        "abs_max": m0["mismatch/abs_diff_max"],
        "abs_mean": m0["mismatch/abs_diff_mean"],
        "ratio": m0["ratio/mean"],
        "clip": m0["clip/frac_low"] + m0["clip/frac_high"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of tables")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = args.sizes.split(",")
    with tempfile.TemporaryDirectory(prefix="rollshard-bench-train-") as tmp:
        root = Path(tmp)
        models = build_models(root, sizes)
        results = [bench_size(s, models[s], root, args) for s in sizes]

    print(f"\ntorch threads {torch.get_num_threads()}, {args.steps} steps of {args.groups_per_step} groups x "
          f"{args.n_samples} rows, micro-batch budget {args.micro_batch_tokens} tokens\n")
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "results": results}))
        return
    print("| model | params | tokens/step | micro-batches/step | bare loop, sdpa ms/step | bare loop, varlen ms/step "
          "| trainer ms/step | overhead vs varlen loop | trainer vs sdpa loop |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['size']} | {r['params'] / 1e6:.2f}M | {r['tokens/step']:.0f} | {r['micro/step']:.1f} | "
              f"{r['bare_ms']:.1f} | {r['bare_varlen_ms']:.1f} | {r['trainer_ms']:.1f} | {100 * r['overhead']:+.1f}% | "
              f"{r['speedup_vs_sdpa_loop']:.2f}x |")
    print("\n| model | trainer tokens/s (real loader) | packing efficiency | data wait share (step 1 / later) |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['size']} | {r['tok_s']:.0f} | {r['packing']:.3f} | {100 * r['wait_first']:.1f}% / {100 * r['wait']:.2f}% |")
    print("\n| model | step 0 max abs(logp - rollout_logp) | mean | ratio mean | clip fraction |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['size']} | {r['abs_max']:.2e} | {r['abs_mean']:.2e} | {r['ratio']:.7f} | {r['clip']:.3f} |")


if __name__ == "__main__":
    main()

"""Trainer benchmark: step time vs a bare torch loop, packing, data wait, step-0 logprob agreement.

    .venv/bin/python tests/bench/bench_train.py [--sizes tiny,small] [--prompts 16] [--n-samples 8]
                                                [--max-new-tokens 128] [--steps 8] [--repeat 5] [--threads N] [--json]

Data: the embedded engine samples the toy task with a tiny GPT-2 model (random
weights, local tokenizer), so the rollout logprobs are an engine's, not the trainer's.
Per model size (``tiny``: the test model, 64 hidden x 2 layers; ``small``: 256 x 4,
same tokenizer, random weights; each samples its own data):

1. Overhead: the trainer's ``run()`` over pre-read steps (advantages, packed logprobs,
   loss and its metrics, backward per micro-batch, clipping, AdamW, metrics merged and
   written to ``metrics.jsonl``; no data loading, no checkpoint) against a bare loop doing
   the same maths on the same packed micro-batches and nothing else: group-normalized
   advantages, ``base_model`` -> the fp32 head at the loss positions / temperature ->
   ``logits[token] - logsumexp`` -> the PPO loss (clip 0.2 / 0.28, dual clip 3) over the
   global token count -> backward, then the gradient clipped to the same norm and the same
   AdamW. Target <= 3%. Each pass starts from freshly loaded models (the trainer: a fresh
   ``Trainer``) and every side trains one untimed warm-up step first, so no window holds
   start-up or first-step allocation. The sides alternate step by step within a pass (the
   trainer's loader runs the bare loops on each step before handing it over), so a shared
   machine's load lands on them alike; the overhead is the median over ``--repeat`` passes
   of each pass's ratio, from wall time and from CPU time. The bare loop runs on the
   trainer's own kernel (``rollshard_varlen``, the overhead's reference) and on ``sdpa``
   (what a plain loop gets: transformers' dense block-diagonal mask of the packed row; the
   speed-up's).
2. The trainer over the real loader: tokens/s, packing efficiency, data wait share.
3. Step 0 with unchanged weights: max and mean |logp - rollout_logp|, ratio, clip
   fraction (targets: <= 1e-5 fp32 CPU, 1, 0).

Prints markdown tables for the README's Performance section, or with ``--json`` one JSON
object on stdout (everything else goes to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rollshard.store.loader import LoaderConfig, RolloutLoader, StepLoader
from rollshard.store.format.schema import GREEDY_TEMPERATURE_EPS
from rollshard.train.attention import VARLEN
from rollshard.train.config import TrainConfig
from rollshard.train.trainer import Trainer

SIZES = {"tiny": None, "small": {"n_embd": 256, "n_layer": 4, "n_head": 4}}
SIDES = ("bare", "trainer", "bare_sdpa")  # bare: the overhead's reference (varlen); bare_sdpa: the speed-up's


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
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the tables or the JSON object alone
        assert generate_main(argv) == 0


def train_config(data: Path, model: Path, out: Path, args, *, steps: int | None = None, **trainer) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "data": {"path": str(data), "groups_per_step": args.groups_per_step,
                     "micro_batch_tokens": args.micro_batch_tokens, "num_epochs": None},
            "model": {"path": str(model)},
            "optim": {"lr": 1e-5},
            "trainer": {"out": str(out), "max_steps": steps or args.steps, "progress": False, "tensorboard": False,
                        **trainer},
        }
    ).validate()


class ListLoader(StepLoader):
    """Pre-read steps, replayed: the trainer's loop without data loading. ``before(i, step)`` runs each time
    the loop asks for step ``i``, which it does once the previous step is trained, logged and saved."""

    def __init__(self, steps, before=None):
        self.steps = steps
        self.before = before or (lambda i, step: None)

    @property
    def datasets(self) -> list:
        return []

    def __iter__(self):
        for i, step in enumerate(self.steps):
            self.before(i, step)
            yield step

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


# -- the bare loop: the trainer's maths (defaults of TrainConfig) and nothing else -----------------------------


def group_advantages(step) -> list[torch.Tensor]:  # per micro-batch [T]
    """GRPO: (r - mean of its group) / (std of its group + 1e-6), broadcast to the loss tokens."""
    mbs = step.micro_batches
    r = torch.cat([mb.rewards for mb in mbs]).double()  # [N]
    g = torch.cat([mb.seq_group for mb in mbs]).long()  # [N]
    G = len(step.group_ids)
    size = torch.bincount(g, minlength=G)  # [G]
    mean = torch.zeros(G, dtype=r.dtype).index_add_(0, g, r) / size  # [G]
    sq = torch.zeros(G, dtype=r.dtype).index_add_(0, g, (r - mean[g]) ** 2)  # [G]
    std = (sq / (size - 1).clamp(min=1)).sqrt()  # [G]
    adv = ((r - mean[g]) / (std[g] + 1e-6)).float().split([mb.num_sequences for mb in mbs])  # [S] each
    return [torch.repeat_interleave(a, (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long()) * mb.loss_mask
            for a, mb in zip(adv, mbs)]


def bare_step(model, optimizer, step, *, max_grad_norm: float, eps: tuple[float, float], dual_clip: float | None) -> None:
    n = max(float(sum(mb.loss_mask.sum() for mb in step.micro_batches)), 1.0)  # global count of loss tokens
    head = model.get_output_embeddings()
    for mb, adv in zip(step.micro_batches, group_advantages(step)):
        at = torch.nonzero(mb.loss_mask > 0).flatten()  # [K] loss positions
        hidden = model.base_model(
            input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False
        ).last_hidden_state[0]  # [T, H]
        temp = mb.temperature[at].float()  # [K]
        temp = torch.where(temp < GREEDY_TEMPERATURE_EPS, torch.ones_like(temp), temp)
        logits = head(hidden.index_select(0, at - 1)) / temp[:, None]  # [K, V] fp32: logits at t-1 score token t
        logp = logits.gather(-1, mb.input_ids[at, None])[:, 0] - torch.logsumexp(logits, -1)  # [K]
        ratio = torch.exp((logp - mb.rollout_logprobs[at]).clamp(-20.0, 20.0))  # [K]
        A = adv[at]  # [K]
        pg = torch.maximum(-A * ratio, -A * ratio.clamp(1.0 - eps[0], 1.0 + eps[1]))  # [K]
        if dual_clip is not None:
            pg = torch.where(A < 0, torch.minimum(pg, -A * dual_clip), pg)  # [K]
        (pg.sum() / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class BareLoop:
    """A freshly loaded model and its AdamW, with the trainer's settings."""

    def __init__(self, model_path: Path, attention: str, config: TrainConfig):
        from transformers import AutoModelForCausalLM

        o = config.optim
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation=attention
        ).eval()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.adam_eps, weight_decay=o.weight_decay
        )
        self.max_norm = o.max_grad_norm if o.max_grad_norm is not None else float("inf")
        self.eps, self.dual_clip = config.loss.clip_range(), config.loss.dual_clip_c

    def step(self, step) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        bare_step(self.model, self.optimizer, step, max_grad_norm=self.max_norm, eps=self.eps, dual_clip=self.dual_clip)
        return time.perf_counter() - t0, time.process_time() - c0


def paired_pass(data: Path, model: Path, out: Path, steps, args) -> dict[str, tuple[float, float]]:
    """Wall and CPU seconds of each side over ``steps``, the sides alternating step by step, so a shared
    machine's load lands on them alike: a fresh ``Trainer`` runs ``run()`` over the steps, and whenever it
    asks for the next step its loader first runs that step on each bare loop (fresh models). Every side
    trains one untimed warm-up step first. The trainer's time of a step runs from the moment it got the step
    to the moment it asked for the next (or ``run()`` returned): the step trained, its metrics merged and
    logged; start-up is outside. CPU time (``process_time``, one torch thread) leaves out the time the
    process waited for a core that other processes held."""
    config = train_config(data, model, out, args, steps=len(steps) + 1)
    bares = {"bare": BareLoop(model, VARLEN, config), "bare_sdpa": BareLoop(model, "sdpa", config)}
    spent = {side: [0.0, 0.0] for side in SIDES}
    got = [0.0, 0.0]  # when the trainer got its current step: wall, CPU

    def trainer_segment() -> None:
        spent["trainer"][0] += time.perf_counter() - got[0]
        spent["trainer"][1] += time.process_time() - got[1]

    def before(i: int, step) -> None:
        if i > 1:  # i - 1 timed steps done (step 0 is the warm-up)
            trainer_segment()
        for name in sorted(bares, reverse=bool(i % 2)):
            wall, cpu = bares[name].step(step)
            if i > 0:
                spent[name][0] += wall
                spent[name][1] += cpu
        got[:] = time.perf_counter(), time.process_time()

    trainer = Trainer(config, loader=ListLoader([steps[0], *steps], before))
    trainer.save = lambda: None  # checkpoint writing is not part of a step
    trainer.run()
    trainer_segment()
    trainer.close()
    return {side: (wall, cpu) for side, (wall, cpu) in spent.items()}


def bench_size(size: str, model: Path, root: Path, args) -> dict:
    data = root / f"data-{size}"
    t0 = time.perf_counter()
    generate(model, data, args)
    gen_s = time.perf_counter() - t0
    steps = read_steps(data, args)
    tokens = sum(s.num_tokens for s in steps)

    passes = [paired_pass(data, model, root / f"pass-{size}-{r}", steps, args) for r in range(args.repeat)]
    wall = {side: [p[side][0] for p in passes] for side in SIDES}
    cpu = {side: [p[side][1] for p in passes] for side in SIDES}
    ratios = [t / b for t, b in zip(wall["trainer"], wall["bare"])]
    cpu_ratios = [t / b for t, b in zip(cpu["trainer"], cpu["bare"])]
    ms = {side: [1e3 * t / len(steps) for t in ts] for side, ts in wall.items()}

    real = Trainer(train_config(data, model, root / f"real-{size}", args))
    with contextlib.redirect_stdout(sys.stderr):
        history = real.run()
    params = sum(p.numel() for p in real.backend.params)
    real.close()
    m0 = history[0]
    later = history[1:] or history
    return {
        "size": size,
        "params": params,
        "rows/step": steps[0].num_sequences,
        "tokens/step": tokens / len(steps),
        "micro/step": statistics.mean(len(s.micro_batches) for s in steps),
        "gen_s": gen_s,
        "repeat": args.repeat,
        "bare_sdpa_ms": statistics.median(ms["bare_sdpa"]),
        "bare_ms": statistics.median(ms["bare"]),
        "trainer_ms": statistics.median(ms["trainer"]),
        "passes_ms": ms,
        "overhead": statistics.median(ratios) - 1,  # against the same attention kernel, median of the passes
        "overhead_passes": [r - 1 for r in ratios],
        "overhead_cpu": statistics.median(cpu_ratios) - 1,  # the same from CPU time: no wait for a busy core
        "overhead_cpu_passes": [r - 1 for r in cpu_ratios],
        "speedup_vs_sdpa_loop": statistics.median(s / t for s, t in zip(wall["bare_sdpa"], wall["trainer"])),
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
    ap.add_argument("--repeat", type=int, default=5, help="passes, each with the sides interleaved (median)")
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

    setting = {
        "threads": torch.get_num_threads(), "steps": args.steps, "groups_per_step": args.groups_per_step,
        "rows_per_group": args.n_samples, "micro_batch_tokens": args.micro_batch_tokens, "repeat": args.repeat,
        "load_average": list(os.getloadavg()),
    }  # fmt: skip
    if args.json:
        print(json.dumps({**setting, "results": results}))
        return
    print(f"\ntorch threads {setting['threads']}, {args.steps} steps of {args.groups_per_step} groups x "
          f"{args.n_samples} rows, micro-batch budget {args.micro_batch_tokens} tokens, {args.repeat} passes "
          f"interleaved step by step (median), load average {setting['load_average'][0]:.2f}\n")
    print("| model | params | tokens/step | micro-batches/step | bare loop, sdpa ms/step | bare loop, varlen ms/step "
          "| trainer ms/step | overhead vs varlen loop (passes min..max) | overhead, CPU time | trainer vs sdpa loop |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        lo, hi = min(r["overhead_passes"]), max(r["overhead_passes"])
        print(f"| {r['size']} | {r['params'] / 1e6:.2f}M | {r['tokens/step']:,.0f} | {r['micro/step']:.1f} | "
              f"{r['bare_sdpa_ms']:,.1f} | {r['bare_ms']:,.1f} | {r['trainer_ms']:,.1f} | {100 * r['overhead']:+.1f}% "
              f"({100 * lo:+.1f}..{100 * hi:+.1f}%) | {100 * r['overhead_cpu']:+.1f}% | {r['speedup_vs_sdpa_loop']:.2f}x |")
    print("\n| model | trainer tokens/s (real loader) | packing efficiency | data wait share (step 1 / later) |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['size']} | {r['tok_s']:,.0f} | {r['packing']:.3f} | {100 * r['wait_first']:.1f}% / {100 * r['wait']:.2f}% |")
    print("\n| model | step 0 max abs(logp - rollout_logp) | mean | ratio mean | clip fraction |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['size']} | {r['abs_max']:.2e} | {r['abs_mean']:.2e} | {r['ratio']:.7f} | {r['clip']:.3f} |")


if __name__ == "__main__":
    main()

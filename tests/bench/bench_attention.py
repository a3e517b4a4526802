"""Packed attention: memory and time of one micro-batch forward + backward, per attention implementation.

    .venv/bin/python tests/bench/bench_attention.py [--tokens 16384] [--preset tiny-qwen3] [--model PATH]
        [--variants sdpa,rollshard_varlen] [--lengths 64:1024] [--repeat 3] [--threads 2] [--forward-only] [--json]

One packed micro-batch of ``--tokens`` tokens (sequence lengths drawn uniformly from ``--lengths LO:HI``
with a fixed seed, the last one cut to fit; the tiny presets' context is 1024) goes through the trainer's
path: :class:`~rollshard.train.logprobs.PackedPolicy` (position ids restarting per sequence, no attention
mask), the fp32 logprobs of every token after each sequence's first, then backward of their sum. Per
variant (``sdpa``: transformers' dense ``[T, T]`` block-diagonal mask; ``rollshard_varlen``: causal sdpa
per sequence; ``eager``; ``flex_attention``, Qwen-type models only, forward only on CPU) a fresh
subprocess loads the model and runs ``--repeat`` passes, so its peak resident set
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is its own:

* ``peak_mib``: the process's peak RSS; ``over_load_mib``: the peak minus the RSS after loading the model
  (the activations, the mask and the attention's transients; the weights are the same for all variants);
* ``first_s``: the first pass (with flex attention, its compile); ``best_s``: the fastest later pass;
* ``max_logp_diff`` / ``max_grad_diff``: against the first variant, the largest difference of the logprobs
  and of the gradients (every parameter; ``max_grad``: the largest gradient, for scale: the loss sums ~T
  logprobs), so the figures compare the same computation.

The model is a preset of ``rollshard-train init-model`` built in a temporary folder (random weights), or
``--model``. Prints a markdown table (``--json``: the figures as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SEED = 0


def lengths_of(tokens: int, lo: int, hi: int) -> list[int]:
    """Sequence lengths uniform in [lo, hi] (fixed seed) summing to ``tokens``."""
    g = torch.Generator().manual_seed(SEED)
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(args) -> dict:
    from transformers import AutoModelForCausalLM

    from rollshard.train.logprobs import PackedPolicy, chunk_rows, packed_logprobs

    torch.set_num_threads(args.threads)
    lens = lengths_of(args.tokens, *map(int, args.lengths.split(":")))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=args.worker)
    model.config.use_cache = False
    model.eval()
    policy = PackedPolicy(model, chunk_tokens=chunk_rows(model.get_output_embeddings().weight.shape[0], 512.0))
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, model.config.vocab_size, (args.tokens,), generator=g)  # [T]
    pos = torch.cat([torch.arange(n) for n in lens])  # [T] restarting at 0
    mask = (pos > 0).float()  # [T]
    temperature = torch.ones(args.tokens)  # [T]
    loaded = rss_mib()
    times = []
    for _ in range(args.repeat):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        try:
            with torch.set_grad_enabled(not args.forward_only):
                logp, _ = packed_logprobs(
                    policy, input_ids=ids, position_ids=pos, loss_mask=mask, temperature=temperature
                )  # [T]
                if not args.forward_only:
                    logp.sum().backward()
        except (NotImplementedError, RuntimeError) as e:  # flex attention has no CPU backward (torch 2.13)
            return {"variant": args.worker, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        times.append(time.perf_counter() - t0)
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    torch.save({"logp": logp.detach(), "grad": torch.cat(grads) if grads else torch.zeros(0)}, args.out)
    peak = rss_mib()
    return {
        "variant": args.worker, "tokens": args.tokens, "sequences": len(lens), "peak_mib": round(peak),
        "over_load_mib": round(peak - loaded), "first_s": round(times[0], 3),
        "best_s": round(min(times[1:] or times), 3),
    }  # fmt: skip


def run(args) -> list[dict]:
    results = []
    first = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from rollshard.generate.models import init_model

            args.model = str(init_model(Path(tmp) / args.preset, preset=args.preset, seed=0))
        for variant in args.variants.split(","):
            out = Path(tmp) / f"{variant}.pt"
            cmd = [
                sys.executable, __file__, "--worker", variant, "--model", args.model, "--tokens", str(args.tokens),
                "--lengths", args.lengths, "--repeat", str(args.repeat), "--threads", str(args.threads),
                "--out", str(out),
            ] + (["--forward-only"] if args.forward_only else [])  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                r = {"variant": variant, "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
            else:
                r = json.loads(proc.stdout.strip().splitlines()[-1])
            if out.exists():
                got = torch.load(out)
                if first is None:
                    first = got
                r["max_logp_diff"] = float((got["logp"] - first["logp"]).abs().max())
                if got["grad"].numel() and first["grad"].numel():
                    r["max_grad_diff"] = float((got["grad"] - first["grad"]).abs().max())
                    r["max_grad"] = float(first["grad"].abs().max())
            results.append(r)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--preset", default="tiny-qwen3")
    ap.add_argument("--model", default=None, help="a model folder instead of --preset")
    ap.add_argument("--variants", default="sdpa,rollshard_varlen")
    ap.add_argument("--lengths", default="64:1024", help="LO:HI, sequence lengths drawn uniformly")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--forward-only", action="store_true", help="no backward (flex attention on CPU has none)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    results = run(args)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    cols = ["variant", "tokens", "sequences", "peak_mib", "over_load_mib", "first_s", "best_s", "max_logp_diff",
            "max_grad_diff", "max_grad", "error"]  # fmt: skip
    cols = [c for c in cols if any(c in r for r in results)]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        cells = [f"{r[c]:.2g}" if c.startswith("max_") and c in r else str(r.get(c, "")) for c in cols]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

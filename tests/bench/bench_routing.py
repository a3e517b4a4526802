"""Routing replay (R3): the trainer's logprob mismatch with and without replay, and what the routing column costs.

    .venv/bin/python tests/bench/bench_routing.py [--prompts 16] [--n-samples 4] [--max-new-tokens 32]
        [--engine-dtype bfloat16] [--layout-tokens 100000] [--json]

Mismatch: per model, ``rollshard-generate`` with the embedded engine in ``--engine-dtype`` (bfloat16: routing
flips between bf16 and fp32) writes ``--prompts`` x ``--n-samples`` rows of the toy task, routing stored; the hf
backend in fp32 then recomputes every response token's logprob twice, with replay off and on, and reports
|logp - rollout_logp| (mean and max over the trained tokens) and the routing agreement (the share of (position,
MoE layer) pairs whose fp32 top-k set equals the engine's). Models: ``tiny-qwen3-moe`` (2 layers, top-2 of 4) and
``small-qwen3-moe`` (4 layers, top-4 of 32), and their dense twins ``tiny-qwen3`` and ``small-qwen3`` (the same
attention, an MLP of the active experts' width). The goal: with replay, a MoE's mismatch within 1.5x of its dense
twin's.

Column bytes: the ``routed_experts`` column chunks' compressed bytes in the shards over the positions stored,
against layers x top_k x 1 byte.

Layout (``--layout-tokens``): Qwen3-30B-A3B's routing shape (48 layers, top-8 of 128 experts), ids drawn from a
skewed expert popularity, rows of 200-1200 positions, written with the writer's settings (zstd level 1) as the
stored ``binary`` bytes, a flat ``list<uint8>`` (dictionary-coded or not) and a nested ``list<list<uint8>>`` per
position: bytes per position on disk and the best of 3 reads into one numpy array.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MODELS = (("tiny-qwen3-moe", "tiny-qwen3"), ("small-qwen3-moe", "small-qwen3"))


def generate(model: Path, out: Path, args) -> None:
    cmd = [sys.executable, "-m", "rollshard.generate", "--engine", f"embedded:{model}", "--dtype", args.engine_dtype,
           "--task", "toy", "--limit", str(args.prompts), "--n-samples", str(args.n_samples), "--max-new-tokens",
           str(args.max_new_tokens), "--temperature", "1.0", "--out", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def mismatch(model: Path, data: Path) -> dict:
    import torch

    from rollshard.store.io.dataset import RolloutDataset
    from rollshard.store.loader import LoaderConfig, RolloutLoader
    from rollshard.train.backends.distributed import DistEnv
    from rollshard.train.backends.hf import HFBackend
    from rollshard.train.config import ModelConfig, OptimConfig

    backend = HFBackend(ModelConfig(path=str(model)), OptimConfig(), env=DistEnv(), total_updates=None)
    cfg = LoaderConfig(groups_per_step=8, shuffle=False, tail="partial", routed_experts=backend.routing is not None,
                       statuses=("completed", "truncated"))
    batches = [mb for step in RolloutLoader(RolloutDataset.open(data), cfg) for mb in step.micro_batches]
    out = {}
    for mode in ("off", "on") if backend.routing is not None else ("off",):
        backend.set_routing_replay(mode == "on")
        parts = []
        for mb in batches:
            with torch.no_grad():
                logp, _ = backend.logprobs(mb, grad=False)
            parts.append((logp - mb.rollout_logprobs)[mb.loss_mask > 0].abs())
        d = torch.cat(parts)
        out[mode] = {"tokens": int(d.numel()), "mean": float(d.mean()), "max": float(d.max())}
        if backend.routing is not None:  # the trainer's own top-k against the engine's (replay: on replayed inputs)
            same, pairs = backend.routing_agreement()
            out[mode]["agreement"] = same / pairs
    return out


def column_bytes(data: Path) -> dict:
    stored = positions = 0
    shape = None
    for f in sorted((data / "shards").glob("*.parquet")):
        pf = pq.ParquetFile(f)
        shape = json.loads(pf.schema_arrow.metadata[b"rollshard.config"]).get("routed_experts")
        for rg in range(pf.metadata.num_row_groups):
            meta = pf.metadata.row_group(rg)
            for c in range(meta.num_columns):
                if meta.column(c).path_in_schema == "routed_experts":
                    stored += meta.column(c).total_compressed_size
        t = pf.read(columns=["prompt_tokens", "response_tokens"])
        lengths = [len(p) + len(r) - 1 for p, r in zip(t.column(0).to_pylist(), t.column(1).to_pylist())]
        positions += sum(lengths)
    ideal = shape["layers"] * shape["top_k"]
    return {"shape": shape, "bytes_per_position": stored / positions, "ideal": ideal,
            "ratio": stored / positions / ideal, "positions": positions}


def layout(tokens: int, tmp: Path) -> list[dict]:
    L, K, E = 48, 8, 128
    rng = np.random.default_rng(0)
    popularity = np.log(1 / np.arange(1, E + 1) ** 0.8)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(200, 1200)))
    rows = []
    for n in lengths:
        g = rng.gumbel(size=(n, L, E)) + popularity  # top-k of a skewed distribution: K distinct experts
        rows.append(np.argsort(-g, axis=-1)[..., :K].astype(np.uint8))
    T = sum(lengths)
    flat_values = pa.array(np.concatenate([r.reshape(-1) for r in rows]))
    row_off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    variants = {
        "binary (stored)": (pa.array([r.tobytes() for r in rows], pa.binary()), False),
        "list<uint8>": (pa.array([r.reshape(-1) for r in rows], pa.list_(pa.uint8())), False),
        "list<uint8>, dictionary": (pa.array([r.reshape(-1) for r in rows], pa.list_(pa.uint8())), True),
        "list<list<uint8>> per position": (pa.ListArray.from_arrays(
            pa.array(row_off), pa.ListArray.from_arrays(pa.array(np.arange(T + 1, dtype=np.int32) * L * K),
                                                        flat_values)), False),
    }
    out = []
    for name, (arr, dictionary) in variants.items():
        path = tmp / f"layout-{len(out)}.parquet"
        pq.write_table(pa.table({"x": arr}), path, compression="zstd", compression_level=1, use_dictionary=dictionary,
                       row_group_size=64)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            col = pq.read_table(path).column("x").combine_chunks()
            if name.startswith("binary"):
                values = np.frombuffer(col.buffers()[2], np.uint8)
            elif name.startswith("list<list"):
                values = col.values.values.to_numpy()
            else:
                values = col.values.to_numpy()
            best = min(best, time.perf_counter() - t0)
        assert values.size == T * L * K
        out.append({"layout": name, "bytes_per_position": os.path.getsize(path) / T, "ideal": L * K,
                    "read_s": best, "read_GBps": T * L * K / best / 1e9})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--engine-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--layout-tokens", type=int, default=100_000, help="positions of the layout comparison (0: skip)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from rollshard.generate.models import init_model

    result = {"settings": vars(args), "models": [], "layout": []}
    with tempfile.TemporaryDirectory(prefix="rollshard-bench-routing-") as d:
        tmp = Path(d)
        for moe, dense in MODELS:
            row = {"moe": moe, "dense": dense}
            for preset in (moe, dense):
                model = init_model(tmp / preset, preset=preset, seed=0)
                data = tmp / f"data-{preset}"
                generate(model, data, args)
                row[preset] = mismatch(model, data)
                if preset == moe:
                    row["column"] = column_bytes(data)
            row["replayed_over_dense"] = row[moe]["on"]["mean"] / row[dense]["off"]["mean"]
            result["models"].append(row)
        if args.layout_tokens:
            result["layout"] = layout(args.layout_tokens, tmp)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"engine {args.engine_dtype}, trainer fp32; {args.prompts} prompts x {args.n_samples} samples, "
          f"{args.max_new_tokens} new tokens\n")
    print("| model | agreement | mismatch mean / max, no replay | with replay | dense twin | replayed / dense |")
    print("|---|---|---|---|---|---|")
    for r in result["models"]:
        m, dn = r[r["moe"]], r[r["dense"]]
        print(f"| {r['moe']} | {m['off']['agreement']:.4f} | {m['off']['mean']:.2e} / {m['off']['max']:.2e} | "
              f"{m['on']['mean']:.2e} / {m['on']['max']:.2e} | {dn['off']['mean']:.2e} / {dn['off']['max']:.2e} "
              f"({r['dense']}) | {r['replayed_over_dense']:.2f}x |")
    print("\n| model | routing | column bytes per position | layers x top_k | ratio |")
    print("|---|---|---|---|---|")
    for r in result["models"]:
        c = r["column"]
        print(f"| {r['moe']} | {c['shape']} | {c['bytes_per_position']:.2f} | {c['ideal']} | {c['ratio']:.3f} |")
    if result["layout"]:
        print(f"\nLayout, 48 layers x top-8 of 128 experts, {args.layout_tokens} positions:\n")
        print("| layout | bytes per position | vs 384 | read (best of 3) |")
        print("|---|---|---|---|")
        for x in result["layout"]:
            print(f"| {x['layout']} | {x['bytes_per_position']:.1f} | {x['bytes_per_position'] / x['ideal']:.3f} | "
                  f"{x['read_s'] * 1e3:.1f} ms ({x['read_GBps']:.2f} GB/s) |")


if __name__ == "__main__":
    main()

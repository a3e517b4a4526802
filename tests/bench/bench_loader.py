"""Loader benchmark: throughput into packed tensors, memory flatness, packing efficiency, trainer wait.

    .venv/bin/python tests/bench/bench_loader.py [--groups 2400] [--window 256] [--rss-window 64] [--json]
                                                 [--compute-s 0.25] [--sim-steps 100] [--repeat 3]
    .venv/bin/python tests/bench/bench_loader.py --mix [--groups 2400] [--window 256] [--repeat 3] [--json]
    .venv/bin/python tests/bench/bench_loader.py --supports [--groups 400] [--top-k 20] [--repeat 3] [--json]
    .venv/bin/python tests/bench/bench_loader.py --throughput [--groups 2400] [--repeat 3] [--no-hf] [--json]

1. Throughput: RolloutLoader (world size 1, one epoch, opening included) into packed
   micro-batches vs a bare ``pyarrow.dataset`` scan of the same columns; the same loader
   with its data checks off (``verify_data=False``: no block hash, no exact-type and row
   invariant checks), to show what the checks cost (one epoch is their worst case: each
   shard is hashed once per loader); and rank 0 of 2 (which reads every block and packs
   half). The dataset spans many shuffle windows (``--window``) and row groups, as a real
   one does: reading the first window before the first step is a fixed cost, after which
   reading and packing overlap on two threads.
2. Peak RSS of a child process streaming datasets 10x and 40x larger than the loader's
   window (``--rss-window`` groups plus the prefetched blocks): it should not grow.
3. Packing efficiency on the realistic length mix, for three micro-batch budgets.
4. A simulated trainer: fixed compute time per step; time spent waiting in ``next()``
   over the first ``--sim-steps`` steps.

``--mix`` measures only the weighted mixture (store/loader/mixture.py): groups/s of a 0.7/0.3 mixture
of two datasets of ``--groups`` groups each against the single-dataset loader on one of them
(the mixture runs a reader per source and ends when the 0.7 source runs out; row groups of
4 MB, so that what a source reads ahead is bounded as in a large dataset).

``--throughput`` measures only part 1, side by side in one run (interleaved, best of ``--repeat``): the
bare ``pyarrow.dataset`` scan, the loader (data checks on and off), and the path a TRL user would take
instead: HF ``datasets`` streaming over the shards (``RolloutDataset.to_hf``) and a collate of each batch of
64 rows into padded tensors (``torch.nn.utils.rnn.pad_sequence`` of the ids, logprobs and loss mask)
(``--no-hf`` leaves it out). The rounds are interleaved with the order rotated each round. Beside the
wall-clock figures: each path's process CPU seconds (every thread), which a busy machine disturbs less, the
median of the rounds' ratios, what the data checks cost (best and median of the rounds, in CPU seconds, and in
user CPU seconds alone, the median of the rounds: the system time of this kind of virtual machine swings 10x from
run to run, 0.06-1.3 s for one loader epoch), and the load average before and after. The checks are measured both ways: each block read against its
XXH3-128 (manifest version 4, the default) and against its sha256 (the same shards, hard-linked, under
version-3 manifests: ``loader_sha256_checks``). Then the batch as it was before it was made lean, measured
here only: packing plus ``position_ids`` and the temperature written as ``[T]`` arrays (five ``[T]`` arrays
per step instead of three), end to end in the loader and as packing alone on one thread; and both at once
(``loader_before``: the five arrays and the sha256 checks, the loader as it was before either change). Beside
packing alone, the copy floor: the step's three ``[T]`` arrays written from its rows and nothing else, what any
packed layout of these columns costs at least.

``--supports`` measures only the schema 1.1 sampling support: the loader's throughput (one
epoch, opening included, data checks on and off) over the same rows with a top-k support
(``--top-k``, default 20) and without, and the support tensors' share of a step.

Rows come from store/synthetic.py (prompts 200-1,000 tokens, responses 100-4,000,
groups of 8). Prints markdown tables for the README's Performance section.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.loader import SMALL_COLUMNS, TOKEN_COLUMNS, LoaderConfig, RolloutLoader
from rollshard.store.loader.mixture import MixtureLoader
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter, WriterOptions

GROUP_SIZE = 8
BASE_GROUPS = 100  # distinct synthetic groups, renamed and repeated to reach larger sizes quickly


def make_dataset(path: Path, n_groups: int, base: pa.Table, options: WriterOptions) -> RolloutDataset:
    """``n_groups`` groups: copies of ``base`` under new ids, written a few groups at a time."""
    with ShardWriter(path, writer_id="bench", options=options) as w:
        for c in range(-(-n_groups // BASE_GROUPS)):
            n = min(BASE_GROUPS, n_groups - c * BASE_GROUPS)
            t = base.slice(0, n * GROUP_SIZE)
            for col in ("sample_id", "prompt_id", "group_id"):
                renamed = pc.binary_join_element_wise(f"c{c}-", t.column(col), "")
                t = t.set_column(t.schema.get_field_index(col), col, renamed)
            for i in range(0, t.num_rows, 4 * GROUP_SIZE):
                w.write_groups(t.slice(i, 4 * GROUP_SIZE))
    return RolloutDataset.open(path)


def best_of(repeat: int, fn):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def scan_tokens(ds: RolloutDataset) -> int:
    n = 0
    for batch in ds.to_arrow().to_batches(columns=SMALL_COLUMNS + TOKEN_COLUMNS):
        for col in ("prompt_tokens", "response_tokens"):
            n += pc.sum(pc.list_value_length(batch.column(col))).as_py() or 0
    return n


def trl_path(ds: RolloutDataset, batch_rows: int = 64) -> int:
    """HF streaming rows collated into padded tensors, as a TRL user's DataLoader would; returns the tokens seen."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    def collate(rows: list[dict]) -> int:
        ids = [torch.tensor(r["prompt_tokens"] + r["response_tokens"]) for r in rows]
        batch = {
            "input_ids": pad_sequence(ids, batch_first=True),
            "attention_mask": pad_sequence([torch.ones(len(x), dtype=torch.long) for x in ids], batch_first=True),
            "logprobs": pad_sequence([torch.tensor(r["rollout_logprobs"]) for r in rows], batch_first=True),
            "loss_mask": pad_sequence([torch.tensor(r["loss_mask"]) for r in rows], batch_first=True),
            "reward": torch.tensor([r["reward"] for r in rows]),
        }
        return int(batch["attention_mask"].sum())

    hf = ds.to_hf(streaming=True).select_columns(["prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask",
                                                  "reward"])
    tokens, rows = 0, []
    for row in hf:
        rows.append(row)
        if len(rows) == batch_rows:
            tokens, rows = tokens + collate(rows), []
    return tokens + (collate(rows) if rows else 0)


def pack_with_per_token_arrays(seqs, budget: int, support_budget=None):
    """packing.pack_step plus what the batch carried before it was made lean, measured only here: ``position_ids``
    and the temperature as ``[T]`` arrays written on the host (five ``[T]`` arrays per step instead of three), exactly
    as pack wrote them (pooled buffers, a concatenation of aranges, a fill of each sequence's slice)."""
    from rollshard.store.loader import packing as P

    step = P.pack_step(seqs, budget, support_budget)
    batches = step.batches
    if not batches:
        return step
    lens = [n for b in batches for n in (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist()]
    total = sum(lens)
    positions = np.arange(max(lens), dtype=np.int64)
    position_ids = P.pooled_array(total, np.int64)  # [T]
    np.concatenate([positions[:n] for n in lens], out=position_ids)
    temperature = P.pooled_array(total, np.float32)  # [T]
    temps = np.concatenate([b.temperatures.numpy() for b in batches])  # [S]
    cu = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    for k, t in enumerate(temps.tolist()):
        temperature[cu[k] : cu[k + 1]] = t
    lo = 0
    for b in batches:  # each micro-batch keeps its views alive, as the two fields did
        b.per_token_arrays = (position_ids[lo : lo + b.num_tokens], temperature[lo : lo + b.num_tokens])
        lo += b.num_tokens
    return step


def loader_run_per_token(ds, config: LoaderConfig) -> dict:
    """loader_run with pack_with_per_token_arrays in place of the loader's packing (bench only)."""
    import rollshard.store.loader.assemble as loader_pack

    real = loader_pack.pack_step
    loader_pack.pack_step = pack_with_per_token_arrays
    try:
        return loader_run(ds, config)
    finally:
        loader_pack.pack_step = real


def pack_only(ds: RolloutDataset, config: LoaderConfig, repeat: int) -> dict:
    """M tokens/s of packing alone (one thread, no reading) on one epoch's steps: the lean batch and the one
    before (five [T] arrays)."""
    import rollshard.store.loader.assemble as loader_pack
    from rollshard.store.loader.packing import pack

    steps, real = [], loader_pack.gather_sequences

    def keep(groups):
        out = real(groups)
        steps.append(out[0])
        return out

    loader_pack.gather_sequences = keep
    try:
        loader_run(ds, config)
    finally:
        loader_pack.gather_sequences = real
    tokens = sum(int(s.lengths().sum()) for s in steps)
    best = {"lean": float("inf"), "per_token_arrays": float("inf"), "copy_floor": float("inf")}
    for _ in range(repeat):
        for name, fn in (("lean", pack), ("per_token_arrays", pack_with_per_token_arrays), ("copy_floor", copy_floor)):
            t0 = time.perf_counter()
            for s in steps:
                fn(s, config.micro_batch_tokens)
            best[name] = min(best[name], time.perf_counter() - t0)
    return {"steps": len(steps), "tokens_per_step": tokens / len(steps),
            "m_tokens_per_s": {k: tokens / t / 1e6 for k, t in best.items()}}


def copy_floor(seqs, budget: int) -> None:
    """What any packed layout of a step costs at least: its three [T] arrays written once from the rows (the
    tokens, the logprobs, the mask; no bin packing, no micro-batch, no per-sequence figure)."""
    total = int(seqs.lengths().sum())
    ids, logprobs, mask = np.empty(total, np.int64), np.empty(total, np.float32), np.empty(total, np.float32)
    n = len(seqs.prompt)
    np.concatenate([t for i in range(n) for t in (seqs.prompt[i], seqs.response[i])], out=ids)
    zeros = np.zeros(max(len(p) for p in seqs.prompt), np.float32)
    np.concatenate([t for i in range(n) for t in (zeros[: len(seqs.prompt[i])], seqs.logprobs[i])], out=logprobs)
    np.concatenate([t for i in range(n) for t in (zeros[: len(seqs.prompt[i])], seqs.mask[i])], out=mask)


def sha256_only(ds: RolloutDataset, dst: Path) -> RolloutDataset:
    """The same shards (hard links: the same bytes, the same page cache) under version-3 manifests: every byte
    range with its sha256 and no XXH3-128, so the loader checks each block read against its sha256."""
    for path in (Path(ds.storage.root) / "shards").rglob("*.parquet"):
        (dst / path.relative_to(ds.storage.root)).parent.mkdir(parents=True, exist_ok=True)
        os.link(path, dst / path.relative_to(ds.storage.root))
    (dst / "_manifests").mkdir()
    for path in (Path(ds.storage.root) / "_manifests").glob("*.json"):
        doc = json.loads(path.read_text())
        for entry in doc["shards"]:
            entry.pop("footer_xxh3")
            for rg in entry["row_groups"]:
                rg.pop("xxh3")
        doc["manifest_version"] = 3
        (dst / "_manifests" / path.name).write_text(json.dumps(doc))
    out = RolloutDataset.open(dst)
    assert not any(s.has_fast_hashes for s in out.shards) and all(s.has_ranges for s in out.shards)
    return out


def throughput_bench(tmp: Path, base: pa.Table, args) -> None:
    ds = make_dataset(tmp / "main", args.groups, base, WriterOptions())
    sha = sha256_only(ds, tmp / "sha256")
    assert all(s.has_fast_hashes for s in ds.shards)
    scan_tokens(ds)  # warm the page cache for all
    full = LoaderConfig(tail="partial", shuffle_window=args.window)
    unchecked = dataclasses.replace(full, verify_data=False)
    paths = {
        "bare_scan": lambda: scan_tokens(ds),
        "loader": lambda: loader_run(ds, full)["tokens"],
        "loader_unchecked": lambda: loader_run(ds, unchecked)["tokens"],
        "loader_sha256_checks": lambda: loader_run(sha, full)["tokens"],
        "loader_per_token_arrays": lambda: loader_run_per_token(ds, full)["tokens"],
        "loader_before": lambda: loader_run_per_token(sha, full)["tokens"],  # both: the loader as it was
        "hf_streaming_collate": lambda: trl_path(ds),
    }
    if args.no_hf:
        del paths["hf_streaming_collate"]
    load_before = os.getloadavg()
    best = {k: float("inf") for k in paths}
    cpu_rounds: dict[str, list[float]] = {k: [] for k in paths}
    user_rounds: dict[str, list[float]] = {k: [] for k in paths}  # user CPU alone: this VM's system time swings 10x
    rounds = []  # per round: each path's seconds
    names = list(paths)
    for r in range(args.repeat):  # interleaved, the order rotated: a change in machine load hits every path alike
        times = {}
        for name in names[r % len(names):] + names[: r % len(names)]:
            c0, u0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
            t, n = best_of(1, paths[name])
            cpu_rounds[name].append(time.process_time() - c0)
            user_rounds[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_utime - u0)
            assert n == ds.num_tokens, (name, n, ds.num_tokens)
            best[name] = min(best[name], t)
            times[name] = t
        rounds.append(times)
    out = {"rows": ds.num_rows, "tokens": ds.num_tokens, "mb": ds.num_bytes / 1e6, "repeat": args.repeat,
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "m_tokens_per_s": {k: ds.num_tokens / t / 1e6 for k, t in best.items()},
           "vs_bare_scan": {k: best["bare_scan"] / t for k, t in best.items()}}
    cpu = {k: min(v) for k, v in cpu_rounds.items()}  # process CPU seconds (every thread), best of the rounds
    out["cpu_s"] = cpu
    out["cpu_vs_bare_scan"] = {k: cpu["bare_scan"] / c for k, c in cpu.items()}
    out["vs_bare_scan_median"] = {k: float(np.median([r["bare_scan"] / r[k] for r in rounds])) for k in paths}
    out["vs_bare_scan_rounds"] = {k: [r["bare_scan"] / r[k] for r in rounds] for k in paths}
    # What the data checks cost: the share of the checked loader's time the unchecked one saves.
    out["data_checks_cost"] = {  # checked against each range's XXH3-128 (the default), and against its sha256
        name: {"best": 1 - best["loader_unchecked"] / best[k],
               "median": float(np.median([1 - r["loader_unchecked"] / r[k] for r in rounds]))}
        for name, k in (("xxh3", "loader"), ("sha256", "loader_sha256_checks"))}
    out["data_checks_cost_cpu"] = {name: 1 - cpu["loader_unchecked"] / cpu[k]
                                   for name, k in (("xxh3", "loader"), ("sha256", "loader_sha256_checks"))}
    user = {k: float(np.median(v)) for k, v in user_rounds.items()}  # user CPU seconds, median of the rounds
    out["user_cpu_s_median"] = user
    out["data_checks_cost_user_cpu"] = {name: 1 - user["loader_unchecked"] / user[k]
                                        for name, k in (("xxh3", "loader"), ("sha256", "loader_sha256_checks"))}
    for k in ("loader_per_token_arrays", "loader_before"):  # > 1: the loader as it is now is faster
        out[f"loader_vs_{k}"] = {"best": best[k] / best["loader"],
                                 "median": float(np.median([r[k] / r["loader"] for r in rounds])),
                                 "cpu": cpu[k] / cpu["loader"]}
    if "hf_streaming_collate" in best:
        out["loader_vs_hf_streaming_collate"] = best["hf_streaming_collate"] / best["loader"]
    out["pack_only"] = pack_only(ds, full, args.repeat)
    say = functools.partial(print, file=sys.stderr) if args.json else print  # --json: figures on stdout
    if args.json:
        print(json.dumps(out, indent=1))
    say(f"dataset: {out['rows']} rows, {out['tokens']:,} tokens, {out['mb']:.0f} MB on disk; load average "
        f"{load_before[0]:.2f} before, {out['loadavg_after'][0]:.2f} after\n")
    say("| read path | M tokens/s | vs bare scan (best) | median of rounds | CPU s | bare scan's CPU / CPU |")
    say("|---|---:|---:|---:|---:|---:|")
    for k in paths:
        say(f"| {k} | {out['m_tokens_per_s'][k]:.1f} | {out['vs_bare_scan'][k]:.2f} | "
            f"{out['vs_bare_scan_median'][k]:.2f} | {cpu[k]:.2f} | {out['cpu_vs_bare_scan'][k]:.2f} |")
    for name, c in out["data_checks_cost"].items():
        say(f"data checks, blocks against their {name}: {100 * c['best']:.1f}% of the loader's time (best of "
            f"{args.repeat}), {100 * c['median']:.1f}% (median of the rounds), "
            f"{100 * out['data_checks_cost_cpu'][name]:.1f}% of its CPU seconds, "
            f"{100 * out['data_checks_cost_user_cpu'][name]:.1f}% of its user CPU seconds (median of the rounds)")
    po = out["pack_only"]
    say(f"packing alone ({po['steps']} steps of {po['tokens_per_step']:,.0f} tokens, one thread): "
        f"{po['m_tokens_per_s']['lean']:.0f} M tokens/s (lean batch), {po['m_tokens_per_s']['per_token_arrays']:.0f} "
        "M tokens/s with position_ids and temperature as [T] arrays (the batch before), "
        f"{po['m_tokens_per_s']['copy_floor']:.0f} M tokens/s writing the three [T] arrays alone (the copy floor)")


def loader_run(ds, config: LoaderConfig, rank: int = 0, world_size: int = 1, *, mix: str | None = None) -> dict:
    tokens = capacity = groups = 0
    loader = MixtureLoader(mix, config) if mix else RolloutLoader(ds, config, rank=rank, world_size=world_size)
    with loader:
        for step in loader:
            tokens += step.num_tokens
            groups += len(step.group_ids)
            capacity += sum(max(config.micro_batch_tokens, b.num_tokens) for b in step.micro_batches)
    return {"tokens": tokens, "groups": groups, "efficiency": tokens / capacity if capacity else 1.0}


def mix_bench(tmp: Path, base: pa.Table, args) -> None:
    """Groups/s of a 0.7/0.3 mixture of two datasets vs the single-dataset loader (opening included)."""
    # 4 MB row groups (blocks of ~25 groups): a source reads ahead one window and `prefetch` blocks, not the
    # whole of a two-block dataset, as it would with 64 MB row groups at this size
    opts = WriterOptions(row_group_bytes=4 << 20, shard_bytes=64 << 20)
    a = make_dataset(tmp / "a", args.groups, base, opts)
    b = make_dataset(tmp / "b", args.groups, base, opts)
    scan_tokens(a), scan_tokens(b)  # warm the page cache
    config = LoaderConfig(shuffle_window=args.window)
    spec = f"{a.storage.root}:0.7,{b.storage.root}:0.3"
    t_one = t_mix = c_one = c_mix = float("inf")
    ratios = []  # per round: the mixture's groups/s over one dataset's
    load_before = os.getloadavg()
    for r in range(args.repeat):  # interleaved, the order alternated, so that a change in load hits both alike
        for side in ("one", "mix") if r % 2 == 0 else ("mix", "one"):
            c0 = time.process_time()
            if side == "one":
                t1, one = best_of(1, lambda: loader_run(a, config))
                t_one, c_one = min(t_one, t1), min(c_one, time.process_time() - c0)
            else:
                t2, mixed = best_of(1, lambda: loader_run(None, config, mix=spec))
                t_mix, c_mix = min(t_mix, t2), min(c_mix, time.process_time() - c0)
        ratios.append((mixed["groups"] / t2) / (one["groups"] / t1))
    say = functools.partial(print, file=sys.stderr) if args.json else print  # --json: figures on stdout
    say(f"two datasets of {args.groups} groups (8 rows each), groups_per_step 8, window {args.window}, "
        f"best of {args.repeat}\n")
    say("| loader | groups | groups/s | M tokens/s |")
    say("|---|---|---|---|")
    say(f"| RolloutLoader, one dataset | {one['groups']} | {one['groups'] / t_one:,.0f} | {n_load(one, t_one):.1f} |")
    say(f"| MixtureLoader a:0.7,b:0.3 | {mixed['groups']} | {mixed['groups'] / t_mix:,.0f} | "
        f"{n_load(mixed, t_mix):.1f} |")
    say(f"\nmixture / one dataset, groups/s: {(mixed['groups'] / t_mix) / (one['groups'] / t_one):.2f} (best), "
        f"{float(np.median(ratios)):.2f} (median of the rounds); groups per CPU second: "
        f"{(mixed['groups'] / c_mix) / (one['groups'] / c_one):.2f}; load average {load_before[0]:.2f} before")
    if args.json:
        print(json.dumps({
            "groups": args.groups, "window": args.window, "repeat": args.repeat,
            "one": {"groups": one["groups"], "seconds": t_one, "m_tokens_per_s": n_load(one, t_one)},
            "mixture": {"groups": mixed["groups"], "seconds": t_mix, "m_tokens_per_s": n_load(mixed, t_mix)},
            "mixture_vs_one": (mixed["groups"] / t_mix) / (one["groups"] / t_one),
            "mixture_vs_one_median": float(np.median(ratios)), "mixture_vs_one_rounds": ratios,
            "cpu_s": {"one": c_one, "mixture": c_mix},  # process CPU seconds (every thread), best of the rounds
            "mixture_vs_one_cpu": (mixed["groups"] / c_mix) / (one["groups"] / c_one),  # groups per CPU second
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        }, indent=1))  # fmt: skip


def supports_bench(tmp: Path, args) -> None:
    """Loader tokens/s over the same rows with a top-k sampling support and without (module docstring)."""
    results: dict = {"groups": args.groups, "top_k": args.top_k, "window": args.window, "runs": {}}
    opts = WriterOptions(row_group_bytes=16 << 20, shard_bytes=256 << 20)
    datasets = {
        "without support": make_dataset(tmp / "plain", args.groups, synthetic_table(BASE_GROUPS, GROUP_SIZE, seed=0), opts),
        f"top_k={args.top_k} support": make_dataset(
            tmp / "sup", args.groups, synthetic_table(BASE_GROUPS, GROUP_SIZE, seed=0, top_k=args.top_k), opts),
    }
    for ds in datasets.values():
        scan_tokens(ds)  # warm the page cache
    configs = {"checks on": LoaderConfig(tail="partial", shuffle_window=args.window)}
    configs["checks off"] = dataclasses.replace(configs["checks on"], verify_data=False)
    best = {(d, c): float("inf") for d in datasets for c in configs}
    runs = {}
    for _ in range(args.repeat):  # interleaved, so that a change in machine load hits all alike
        for d, ds in datasets.items():
            for c, cfg in configs.items():
                t, runs[d, c] = best_of(1, lambda: loader_run(ds, cfg))
                best[d, c] = min(best[d, c], t)
    for (d, c), t in best.items():
        r = runs[d, c]
        results["runs"][f"{d}, {c}"] = {"tokens": r["tokens"], "seconds": t, "m_tokens_per_s": r["tokens"] / t / 1e6,
                                        "bytes_on_disk": datasets[d].num_bytes}
    with RolloutLoader(datasets[f"top_k={args.top_k} support"], configs["checks on"]) as loader:
        b = next(iter(loader)).micro_batches[0]
        core = sum(getattr(b, n).nbytes for n in ("input_ids", "loss_mask", "rollout_logprobs", "temperatures"))
        extra = sum(getattr(b, n).nbytes for n in ("sampling_logprobs", "has_support", "support_ids", "support_offsets"))
    results["micro_batch_bytes"] = {"token_tensors": core, "support_tensors": extra}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.groups} groups of 8 rows, window {args.window}, best of {args.repeat}\n")
    print("| dataset, loader | on disk | M tokens/s | vs without support |")
    print("|---|---:|---:|---:|")
    for (d, c), t in best.items():
        r = results["runs"][f"{d}, {c}"]
        ref = results["runs"][f"without support, {c}"]["m_tokens_per_s"]
        print(f"| {d}, {c} | {r['bytes_on_disk'] / 1e6:.0f} MB | {r['m_tokens_per_s']:.2f} | "
              f"{r['m_tokens_per_s'] / ref:.2f} |")
    print(f"\nfirst micro-batch: {core / 1e6:.1f} MB of token tensors, {extra / 1e6:.1f} MB of support tensors")


def rss_child(path: str, window: int, prefetch: int) -> None:
    """Run in a child process: stream a dataset, print peak RSS before and after."""
    ds = RolloutDataset.open(path)
    config = LoaderConfig(shuffle_window=window, prefetch=prefetch, tail="partial")
    loader = RolloutLoader(ds, config)
    before = current_rss_mb()
    tokens = sum(step.num_tokens for step in loader)
    peak = peak_rss_mb()
    print(json.dumps({"before_mb": before, "peak_mb": peak, "tokens": tokens, "bytes": ds.num_bytes}))


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM; ru_maxrss would carry the parent's peak across fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def simulated_trainer(ds: RolloutDataset, compute_s: float, window: int, steps: int) -> dict:
    waits = []
    with RolloutLoader(ds, LoaderConfig(shuffle_window=window)) as loader:
        t_start = time.perf_counter()
        it = iter(loader)
        while len(waits) < steps:
            t0 = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            waits.append(time.perf_counter() - t0)
            time.sleep(compute_s)  # the trainer's forward/backward/optimizer step
        total = time.perf_counter() - t_start
    steady = waits[1:]
    return {
        "steps": len(waits),
        "first_s": waits[0],
        "wait_frac": sum(waits) / total,
        "steady_wait_frac": sum(steady) / (len(steady) * compute_s + sum(steady)),
        "steady_max_ms": max(steady) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=2400, help="groups (of 8 rows) in the throughput dataset")
    ap.add_argument("--window", type=int, default=256, help="shuffle window (groups) for the throughput test")
    ap.add_argument("--rss-window", type=int, default=64, help="shuffle window (groups) for the memory test")
    ap.add_argument("--compute-s", type=float, default=0.25, help="simulated compute time per step")
    ap.add_argument("--sim-steps", type=int, default=100, help="steps of the simulated trainer")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mix", action="store_true", help="measure only a two-dataset mixture against one dataset")
    ap.add_argument("--supports", action="store_true", help="measure only the loader with sampling supports vs without")
    ap.add_argument("--top-k", type=int, default=20, help="with --supports: ids per token's support")
    ap.add_argument("--throughput", action="store_true", help="measure only the read paths side by side")
    ap.add_argument("--no-hf", action="store_true", help="with --throughput: leave out the HF datasets path (slow)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object (the tables go to stderr)")
    ap.add_argument("--rss-child", nargs=3, metavar=("PATH", "WINDOW", "PREFETCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], int(args.rss_child[1]), int(args.rss_child[2]))
        return

    tmp = Path(tempfile.mkdtemp(prefix="rollshard-bench-loader-"))
    try:
        if args.supports:
            supports_bench(tmp, args)
            return
        base = synthetic_table(BASE_GROUPS, GROUP_SIZE, seed=0)
        if args.throughput:
            throughput_bench(tmp, base, args)
            return
        if args.mix:
            mix_bench(tmp, base, args)
            return
        say = functools.partial(print, file=sys.stderr) if args.json else print  # --json: figures on stdout
        figures: dict = {"loadavg_before": os.getloadavg()}
        ds = make_dataset(tmp / "main", args.groups, base, WriterOptions())
        say(f"dataset: {ds.num_rows} rows, {ds.num_tokens:,} tokens, {ds.num_bytes / 1e6:.0f} MB on disk\n")

        # 1. throughput
        scan_tokens(ds)  # warm the page cache for both
        full = LoaderConfig(tail="partial", shuffle_window=args.window)
        unchecked = dataclasses.replace(full, verify_data=False)
        t_scan = t_load = t_off = t_rank = float("inf")
        for _ in range(args.repeat):  # interleaved, so that a change in machine load hits all four alike
            t, n_scan = best_of(1, lambda: scan_tokens(ds))
            t_scan = min(t_scan, t)
            t, run = best_of(1, lambda: loader_run(ds, full))
            t_load = min(t_load, t)
            t, run_off = best_of(1, lambda: loader_run(ds, unchecked))
            t_off = min(t_off, t)
            t, run2 = best_of(1, lambda: loader_run(ds, full, rank=0, world_size=2))
            t_rank = min(t_rank, t)
        assert run["tokens"] == run_off["tokens"] == n_scan == ds.num_tokens, (run["tokens"], n_scan, ds.num_tokens)
        say("| read path | M tokens/s | vs bare scan |")
        say("|---|---|---|")
        say(f"| pyarrow.dataset scan, same columns | {n_scan / t_scan / 1e6:.1f} | 1.00 |")
        say(f"| RolloutLoader -> packed micro-batches (w=1) | {n_load(run, t_load):.1f} | "
              f"{(run['tokens'] / t_load) / (n_scan / t_scan):.2f} |")
        say(f"| the same, data checks off (verify_data=False) | {n_load(run_off, t_off):.1f} | "
              f"{(run_off['tokens'] / t_off) / (n_scan / t_scan):.2f} |")
        say(f"| RolloutLoader rank 0 of 2 (reads all, packs half) | {n_load(run2, t_rank):.1f} delivered, "
              f"{n_scan / t_rank / 1e6:.1f} read | {(n_scan / t_rank) / (n_scan / t_scan):.2f} |\n")
        figures.update(rows=ds.num_rows, tokens=ds.num_tokens, mb=ds.num_bytes / 1e6,
                       m_tokens_per_s={"bare_scan": n_scan / t_scan / 1e6, "loader": n_load(run, t_load),
                                       "loader_unchecked": n_load(run_off, t_off),
                                       "loader_rank0_of_2_delivered": n_load(run2, t_rank)},
                       data_checks_cost=1 - t_off / t_load)
        say(f"data checks (block hashes, exact types, row invariants): {100 * (1 - t_off / t_load):.1f}% of the "
              f"loader's throughput ({t_load:.3f} s with, {t_off:.3f} s without, best of {args.repeat}); one shard: "
              "no step leaves before the hashes of the blocks it draws from are checked\n")
        # The same rows in 32 MB shards (more, smaller blocks and footers to check).
        multi = make_dataset(tmp / "multi", args.groups, base, WriterOptions(shard_bytes=32 << 20))
        scan_tokens(multi)
        t_mon = t_moff = float("inf")
        for _ in range(args.repeat):
            t_mon = min(t_mon, best_of(1, lambda: loader_run(multi, full))[0])
            t_moff = min(t_moff, best_of(1, lambda: loader_run(multi, unchecked))[0])
        figures["data_checks_cost_32mb_shards"] = 1 - t_moff / t_mon
        say(f"the same rows in {len(multi.shards)} shards of 32 MB: data checks {100 * (1 - t_moff / t_mon):.1f}% of "
              f"the loader's throughput ({t_mon:.3f} s with, {t_moff:.3f} s without, best of {args.repeat})\n")

        # 2. packing efficiency on the realistic length mix
        say("| micro_batch_tokens | groups_per_step | packing efficiency |")
        say("|---|---|---|")
        say(f"| 8192 | 8 | {run['efficiency']:.3f} |")
        figures["packing_efficiency"] = {"8192/8": run["efficiency"]}
        for budget, gps in ((16384, 8), (32768, 8), (32768, 32)):
            config = LoaderConfig(micro_batch_tokens=budget, groups_per_step=gps, shuffle_window=args.window)
            r = loader_run(ds, dataclasses.replace(config, tail="partial"))
            say(f"| {budget} | {gps} | {r['efficiency']:.3f} |")
            figures["packing_efficiency"][f"{budget}/{gps}"] = r["efficiency"]
        say()

        # 3. simulated trainer
        sim = simulated_trainer(ds, args.compute_s, args.window, args.sim_steps)
        figures["simulated_trainer"] = sim
        say(f"| simulated trainer ({args.compute_s * 1e3:.0f} ms compute per step) | value |")
        say("|---|---|")
        say(f"| steps | {sim['steps']} |")
        say(f"| first step ready after | {sim['first_s'] * 1e3:.0f} ms |")
        say(f"| time waiting on data, all steps | {100 * sim['wait_frac']:.2f}% |")
        say(f"| time waiting on data, after the first step | {100 * sim['steady_wait_frac']:.3f}% "
              f"(max {sim['steady_max_ms']:.1f} ms) |\n")

        # 4. memory: datasets 10x and 40x the window
        opts = WriterOptions(row_group_bytes=4 << 20, shard_bytes=64 << 20)
        w = args.rss_window
        say(f"| dataset (window {w} groups, prefetch 2) | on disk | RSS before | peak RSS while streaming |")
        say("|---|---|---|---|")
        for mult in (10, 40):
            path = make_dataset(tmp / f"rss{mult}", mult * w, base, opts).storage.root
            out = subprocess.run(
                [sys.executable, __file__, "--rss-child", path, str(w), "2"],
                capture_output=True, text=True, check=True,
            )
            r = json.loads(out.stdout)
            figures.setdefault("rss", {})[f"{mult}x"] = r
            say(f"| {mult}x window ({mult * w} groups) | {r['bytes'] / 1e6:.0f} MB | "
                  f"{r['before_mb']:.0f} MB | {r['peak_mb']:.0f} MB |")
            shutil.rmtree(path)
        figures["loadavg_after"] = os.getloadavg()
        if args.json:
            print(json.dumps(figures, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def n_load(run: dict, t: float) -> float:
    return run["tokens"] / t / 1e6


if __name__ == "__main__":
    main()

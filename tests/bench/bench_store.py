"""Store benchmark: shard writer vs bare pyarrow, Parquet vs JSON lines and pickle, scan speed.

    .venv/bin/python tests/bench/bench_store.py [--groups 250] [--group-size 8] [--repeat 3]
    .venv/bin/python tests/bench/bench_store.py --supports [--groups 60] [--repeat 3] [--json]

Synthetic rows with realistic shapes (store/synthetic.py): prompts 200-1,000 tokens,
responses 100-4,000, Zipf token ids over a 150k vocabulary, policy-like logprobs.
Prints markdown tables (the README's Performance section). The shard writer (one group per call and
32 groups per call) and the bare ParquetWriter of the default setting are timed side by side, round
after round (``--repeat``): ratios of the best times, and the median of the rounds' ratios.

``--supports`` measures the schema 1.1 sampling support instead: bytes per response token
on disk without a support and with top_k = 20 and 50 (store/synthetic.py: the sampled
token plus k-1 other distinct Zipf ids, ascending), for the stored layout (nested
``list<list<int32>>``) against flat ids plus per-token sizes (two ``list<int32>`` columns);
the time to read the support into flat numpy ids and offsets for each; and the shard
writer's throughput (validation included) against a bare ParquetWriter.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle  # only to measure slime's dump format; rollshard never stores data as pickle
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.format.schema import ROW_SCHEMA
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import DICTIONARY_COLUMNS, ShardWriter, WriterOptions


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def groups(table: pa.Table, group_size: int) -> list[pa.Table]:
    return [table.slice(i, group_size) for i in range(0, table.num_rows, group_size)]


SETTINGS = dict(compression="zstd", compression_level=1, use_dictionary=DICTIONARY_COLUMNS)  # the writer's


def flat_layout(table: pa.Table) -> pa.Table:
    """The support as flat ids per row plus the size of each token's support (the alternative layout)."""
    sup = table.column("sampling_support").combine_chunks()
    inner = sup.values
    row_off = sup.offsets.to_numpy()
    in_off = inner.offsets.to_numpy()
    ids = pa.ListArray.from_arrays(pa.array(in_off[row_off]), inner.values)
    sizes = pa.ListArray.from_arrays(sup.offsets, pa.array(np.diff(in_off).astype(np.int32)))
    return table.drop_columns(["sampling_support"]).append_column("support_ids", ids).append_column("support_sizes", sizes)


def read_nested(path: str) -> int:
    """Flat ids and per-token offsets of every row group's support, as the loader reads them."""
    n = 0
    pf = pq.ParquetFile(path)
    for i in range(pf.num_row_groups):
        col = pf.read_row_group(i, columns=["sampling_support"]).column(0).combine_chunks()
        ids, offsets = col.values.values.to_numpy(), col.values.offsets.to_numpy()
        n += len(ids) + len(offsets)
    return n


def read_flat(path: str) -> int:
    n = 0
    pf = pq.ParquetFile(path)
    for i in range(pf.num_row_groups):
        t = pf.read_row_group(i, columns=["support_ids", "support_sizes"])
        ids = t.column(0).combine_chunks().values.to_numpy()
        offsets = np.concatenate([[0], np.cumsum(t.column(1).combine_chunks().values.to_numpy())])
        n += len(ids) + len(offsets)
    return n


def supports_bench(args) -> None:
    tmp = tempfile.mkdtemp(prefix="rollshard-bench-supports-")
    out: dict = {"groups": args.groups, "group_size": args.group_size, "layouts": {}}
    try:
        for k in (None, 20, 50):
            table = synthetic_table(args.groups, args.group_size, seed=0, top_k=k)
            resp = pc.sum(pc.list_value_length(table["response_tokens"])).as_py()
            layouts = {"nested list<list<int32>> (stored)": table}
            if k is not None:
                layouts["flat ids + per-token sizes"] = flat_layout(table)
            for name, t in layouts.items():
                path = os.path.join(tmp, "s.parquet")
                write = best_of(args.repeat, lambda: pq.write_table(t, path, row_group_size=1 << 30, **SETTINGS))
                size = os.path.getsize(path)
                read = None
                if k is not None:
                    reader = read_nested if name.startswith("nested") else read_flat
                    read = best_of(args.repeat, lambda: reader(path))
                key = "none" if k is None else f"top_k={k}, {name}"
                out["layouts"][key] = {"response_tokens": resp, "bytes": size, "bytes_per_response_token": size / resp,
                                       "write_s": write, "read_support_s": read, "arrow_mb": t.nbytes / 1e6}
            if k == 20:
                def shard_writer() -> None:
                    d = os.path.join(tmp, "ds")
                    shutil.rmtree(d, ignore_errors=True)
                    with ShardWriter(d, writer_id="bench", options=WriterOptions(shard_bytes=1 << 40)) as w:
                        for i in range(0, table.num_rows, 32 * args.group_size):
                            w.write_groups(table.slice(i, 32 * args.group_size))

                def bare() -> None:
                    with pq.ParquetWriter(os.path.join(tmp, "bare.parquet"), ROW_SCHEMA, **SETTINGS) as w:
                        for i in range(0, table.num_rows, 32 * args.group_size):
                            w.write_table(table.slice(i, 32 * args.group_size))

                t_writer, t_bare = best_of(args.repeat, shard_writer), best_of(args.repeat, bare)
                out["writer_top_k_20"] = {"writer_s": t_writer, "bare_s": t_bare, "ratio": t_bare / t_writer,
                                          "arrow_mb": table.nbytes / 1e6}
    finally:
        shutil.rmtree(tmp)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    base = out["layouts"]["none"]["bytes_per_response_token"]
    print(f"{args.groups} groups of {args.group_size}, zstd-1, dictionary off on lists, best of {args.repeat}\n")
    print("| support | bytes / response token | vs none | write s | read support s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in out["layouts"].items():
        read = "-" if r["read_support_s"] is None else f"{r['read_support_s']:.3f}"
        print(f"| {name} | {r['bytes_per_response_token']:.2f} | {r['bytes_per_response_token'] / base:.2f}x | "
              f"{r['write_s']:.3f} | {read} |")
    w = out["writer_top_k_20"]
    print(f"\nShardWriter (validated) vs bare ParquetWriter, top_k=20: {w['writer_s']:.2f} s vs {w['bare_s']:.2f} s "
          f"(throughput ratio {w['ratio']:.2f}; {w['arrow_mb']:.0f} MB of Arrow data)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=None, help="groups (default 1000; 60 with --supports)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--supports", action="store_true", help="measure the schema 1.1 sampling support only")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object (the tables go to stderr)")
    args = ap.parse_args()
    if args.supports:
        args.groups = args.groups or 60
        supports_bench(args)
        return
    args.groups = args.groups or 1000
    # --json: the tables go to stderr, the figures as one JSON object to stdout
    say = functools.partial(print, file=sys.stderr) if args.json else print
    figures: dict = {}

    table = synthetic_table(args.groups, args.group_size, seed=0)
    resp_tokens = pc.sum(pc.list_value_length(table["response_tokens"])).as_py()
    all_tokens = resp_tokens + pc.sum(pc.list_value_length(table["prompt_tokens"])).as_py()
    mb = table.nbytes / 1e6
    say(f"rows {table.num_rows}, response tokens {resp_tokens:,}, all tokens {all_tokens:,}, arrow {mb:.0f} MB\n")
    tmp = tempfile.mkdtemp(prefix="rollshard-bench-")
    parts = groups(table, args.group_size)
    results = []

    def bare(path: str, **kw) -> None:
        with pq.ParquetWriter(path, ROW_SCHEMA, **kw) as w:
            # the same row-group boundaries as the shard writer (64 MiB of Arrow data)
            buf, size = [], 0
            for g in parts:
                buf.append(g)
                size += g.nbytes
                if size >= 64 << 20:
                    w.write_table(pa.concat_tables(buf), row_group_size=sum(b.num_rows for b in buf))
                    buf, size = [], 0
            if buf:
                w.write_table(pa.concat_tables(buf), row_group_size=sum(b.num_rows for b in buf))

    settings = {
        "zstd-1, dict off on lists (default)": dict(compression="zstd", compression_level=1, use_dictionary=DICTIONARY_COLUMNS),
        "zstd-3, dict off on lists": dict(compression="zstd", compression_level=3, use_dictionary=DICTIONARY_COLUMNS),
        "zstd-1, dict on everywhere": dict(compression="zstd", compression_level=1, use_dictionary=True),
        "snappy, dict on everywhere": dict(compression="snappy", use_dictionary=True),
        "zstd-1, byte-stream-split logprobs": dict(
            compression="zstd",
            compression_level=1,
            use_dictionary=DICTIONARY_COLUMNS,
            use_byte_stream_split=["rollout_logprobs"],
        ),
    }
    say("| bare ParquetWriter setting | write MB/s | bytes / response token |")
    say("|---|---:|---:|")
    for name, kw in settings.items():
        path = os.path.join(tmp, "bare.parquet")
        t = best_of(args.repeat, lambda: bare(path, **kw))
        say(f"| {name} | {mb / t:.0f} | {os.path.getsize(path) / resp_tokens:.2f} |")
        figures.setdefault("bare_settings", {})[name] = {"mb_per_s": mb / t,
                                                         "bytes_per_response_token": os.path.getsize(path) / resp_tokens}
        if name.endswith("(default)"):
            bare_time, bare_bytes = t, os.path.getsize(path)

    def shard_writer(per_call: int) -> None:
        d = os.path.join(tmp, "ds")
        shutil.rmtree(d, ignore_errors=True)
        with ShardWriter(d, writer_id="bench", config={"bench": True}, options=WriterOptions(shard_bytes=1 << 40)) as w:
            if per_call == 1:
                for g in parts:
                    w.write_group(g)
            else:
                for i in range(0, table.num_rows, per_call * args.group_size):
                    w.write_groups(table.slice(i, per_call * args.group_size))

    # Side by side: each round times the bare writer (the default setting) and both shard-writer modes in turn, so a
    # change in machine load hits all three alike; the ratios are of the best times and the median of the rounds'.
    default = settings["zstd-1, dict off on lists (default)"]
    rounds = []  # per round: (bare, one group per call, 32 groups per call) seconds
    for _ in range(args.repeat):
        rounds.append(tuple(best_of(1, fn) for fn in (lambda: bare(os.path.join(tmp, "bare.parquet"), **default),
                                                      lambda: shard_writer(1), lambda: shard_writer(32))))
    bare_time = min(bare_time, min(r[0] for r in rounds))
    writer_time_1, writer_time = min(r[1] for r in rounds), min(r[2] for r in rounds)
    median_1 = float(np.median([r[0] / r[1] for r in rounds]))
    median_32 = float(np.median([r[0] / r[2] for r in rounds]))
    ds = RolloutDataset.open(os.path.join(tmp, "ds"))
    writer_bytes = ds.num_bytes

    jsonl = os.path.join(tmp, "rows.jsonl")
    rows = table.to_pylist()  # the conversion is not timed: only the dump

    def dump_jsonl() -> None:
        with open(jsonl, "w") as f:
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")

    pkl = os.path.join(tmp, "rows.pkl")

    def dump_pickle() -> None:
        with open(pkl, "wb") as f:
            pickle.dump(rows, f, protocol=pickle.HIGHEST_PROTOCOL)

    jsonl_time = best_of(1, dump_jsonl)
    pickle_time = best_of(args.repeat, dump_pickle)
    results = [
        ("rollshard ShardWriter, write_groups of 32 groups (validated, checksummed, committed)", writer_time, writer_bytes),
        ("rollshard ShardWriter, write_group per group", writer_time_1, writer_bytes),
        ("bare pyarrow ParquetWriter, same settings", bare_time, bare_bytes),
        ("JSON lines", jsonl_time, os.path.getsize(jsonl)),
        ("pickle of a list of dicts (slime's dump)", pickle_time, os.path.getsize(pkl)),
    ]
    say("\n| format | write MB/s (arrow MB) | write s | bytes / response token | size vs bare |")
    say("|---|---:|---:|---:|---:|")
    for name, t, size in results:
        say(f"| {name} | {mb / t:.0f} | {t:.2f} | {size / resp_tokens:.2f} | {size / bare_bytes:.3f}x |")
    say(f"\nwriter / bare throughput ratio: {bare_time / writer_time:.3f} (target >= 0.90; median of rounds "
        f"{median_32:.3f}); one group per call: {bare_time / writer_time_1:.3f} (median of rounds {median_1:.3f})")
    say(f"writer / bare bytes ratio: {writer_bytes / bare_bytes:.4f} (target <= 1.03)")
    figures.update(rows=table.num_rows, response_tokens=resp_tokens, arrow_mb=mb,
                   formats={name: {"s": t, "mb_per_s": mb / t, "bytes_per_response_token": size / resp_tokens,
                                   "size_vs_bare": size / bare_bytes} for name, t, size in results},
                   writer_vs_bare_32_groups_per_call=bare_time / writer_time,
                   writer_vs_bare_1_group_per_call=bare_time / writer_time_1,
                   writer_vs_bare_32_groups_per_call_median=median_32,
                   writer_vs_bare_1_group_per_call_median=median_1,
                   writer_rounds_s=[dict(zip(("bare", "one_group_per_call", "32_groups_per_call"), r)) for r in rounds],
                   writer_vs_bare_bytes=writer_bytes / bare_bytes)

    cols = ["group_id", "prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask", "reward"]

    def scan() -> None:
        n = 0
        for batch in pads.dataset(ds.files, format="parquet").to_batches(columns=cols):
            n += batch.num_rows
        assert n == table.num_rows

    scan_time = best_of(args.repeat, scan)
    say(
        f"scan (pyarrow.dataset, training columns): {all_tokens / scan_time / 1e6:.1f} M tokens/s, "
        f"{writer_bytes / scan_time / 1e6:.0f} MB/s of file"
    )

    import polars as pl

    def polars_scan() -> None:
        pl.scan_parquet(ds.files).select(pl.col("response_tokens").list.len().sum()).collect()

    pscan = best_of(args.repeat, polars_scan)
    say(f"scan (polars, response lengths): {resp_tokens / pscan / 1e6:.1f} M tokens/s")
    shutil.rmtree(tmp)
    figures.update(scan_pyarrow_m_tokens_per_s=all_tokens / scan_time / 1e6,
                   scan_polars_m_response_tokens_per_s=resp_tokens / pscan / 1e6)
    if args.json:
        print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

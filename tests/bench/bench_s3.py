"""S3 benchmark: the shard writer and the loader on a real S3-protocol server (moto's, on 127.0.0.1) against
a local directory and against bare pyarrow on the same server, in one run.

    .venv/bin/python tests/bench/bench_s3.py [--groups 200] [--shard-mib 16] [--repeat 3] [--json]

Synthetic rows with realistic shapes (store/synthetic.py). Measured, best of ``--repeat``:

* write: ``ShardWriter`` (conditional multipart uploads, fenced manifests, a lease) into S3, into a local
  directory, and a bare ``pyarrow.parquet.write_table`` of the same shards through pyarrow's S3 filesystem
  (what a user would write without a commit protocol);
* commit: the time of one ``commit()`` of a one-group shard on S3 (upload, ``If-None-Match`` completion,
  ``If-Match`` manifest) and locally (fsync, rename, manifest);
* open and read: ``RolloutDataset.open`` and one epoch of the loader (every block verified) from S3 and
  from the local copy, and a bare ``pyarrow.dataset`` scan of the token columns from S3.

moto keeps objects in its process's memory: these are the protocol's costs on loopback, not a real S3's
latency (tens of ms per request) or bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pyarrow.dataset as pads
import pyarrow.parquet as pq

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.store.io.storage import Storage
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter, WriterOptions


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto's S3 server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=200)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--shard-mib", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = ap.parse_args()

    proc, url = start_moto()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=url, AWS_EC2_METADATA_DISABLED="true")
    import boto3

    tmp = tempfile.mkdtemp(prefix="bench-s3-")
    try:
        table = synthetic_table(args.groups, args.group_size, seed=0)
        groups = [table.slice(i * args.group_size, args.group_size) for i in range(args.groups)]
        options = WriterOptions(shard_bytes=args.shard_mib << 20, row_group_bytes=(args.shard_mib << 20) // 4)
        s3 = boto3.client("s3")
        runs = {"n": 0}

        def fresh(kind: str) -> str:
            runs["n"] += 1
            if kind == "local":
                return os.path.join(tmp, f"ds{runs['n']}")
            s3.create_bucket(Bucket=f"bench-{runs['n']}")
            return f"s3://bench-{runs['n']}/ds"

        def write(kind: str) -> str:
            root = fresh(kind)
            with ShardWriter(root, writer_id="w0", options=options) as w:
                for g in groups:
                    w.write_group(g)
            return root

        last: dict[str, str] = {}

        def timed_write(kind: str):
            last[kind] = write(kind)

        results: dict = {"rows": table.num_rows, "groups": args.groups}
        results["write_s3_s"] = best_of(args.repeat, lambda: timed_write("s3"))
        results["write_local_s"] = best_of(args.repeat, lambda: timed_write("local"))
        s3_root, local_root = last["s3"], last["local"]
        ds_s3 = RolloutDataset.open(s3_root)
        results["shards"] = len(ds_s3.shards)
        results["mib"] = sum(s.bytes for s in ds_s3.shards) / 2**20

        # Bare pyarrow: the same shards' tables written to S3 with no protocol (no hash, manifest or condition).
        shard_tables = [pq.read_table(os.path.join(local_root, s.path)) for s in RolloutDataset.open(local_root).shards]

        def bare_write():
            root = fresh("s3")
            fs, base = Storage(root).fs, root.removeprefix("s3://")
            for i, t in enumerate(shard_tables):
                pq.write_table(t, f"{base}/shards/{i:05d}.parquet", filesystem=fs, compression="zstd",
                               compression_level=1, row_group_size=t.num_rows)

        results["write_bare_pyarrow_s3_s"] = best_of(args.repeat, bare_write)

        def commits(kind: str, n: int = 20) -> float:
            root = fresh(kind)
            small = synthetic_table(n, 2, seed=1, prompt_len=(4, 8), response_len=(2, 6))
            with ShardWriter(root, writer_id="w0") as w:
                t0 = time.perf_counter()
                for i in range(n):
                    w.write_group(small.slice(2 * i, 2))
                    w.commit()
                return (time.perf_counter() - t0) / n

        results["commit_s3_ms"] = 1e3 * min(commits("s3") for _ in range(args.repeat))
        results["commit_local_ms"] = 1e3 * min(commits("local") for _ in range(args.repeat))
        results["open_s3_ms"] = 1e3 * best_of(args.repeat, lambda: RolloutDataset.open(s3_root))
        results["open_local_ms"] = 1e3 * best_of(args.repeat, lambda: RolloutDataset.open(local_root))
        config = LoaderConfig(groups_per_step=8, micro_batch_tokens=32768, shuffle_window=16)

        def epoch(root: str):
            with RolloutLoader(RolloutDataset.open(root), config) as loader:
                for _ in loader:
                    pass

        results["loader_epoch_s3_s"] = best_of(args.repeat, lambda: epoch(s3_root))
        results["loader_epoch_local_s"] = best_of(args.repeat, lambda: epoch(local_root))
        ds = RolloutDataset.open(s3_root)
        cols = ["prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask", "reward"]
        results["bare_scan_s3_s"] = best_of(args.repeat, lambda: pads.dataset(
            ds.files, format="parquet", filesystem=ds.storage.fs).to_table(columns=cols))
        results["ratios"] = {
            "write_s3_vs_local": results["write_s3_s"] / results["write_local_s"],
            "write_s3_vs_bare_pyarrow_s3": results["write_s3_s"] / results["write_bare_pyarrow_s3_s"],
            "loader_s3_vs_local": results["loader_epoch_s3_s"] / results["loader_epoch_local_s"],
            "loader_s3_vs_bare_scan_s3": results["loader_epoch_s3_s"] / results["bare_scan_s3_s"],
        }
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    mib = results["mib"]
    print(f"{results['rows']} rows, {results['shards']} shards, {mib:.1f} MiB (moto on 127.0.0.1)\n")
    print("| measure | S3 | local | bare pyarrow on S3 |\n|---|---|---|---|")
    print(f"| write | {results['write_s3_s']:.2f} s ({mib / results['write_s3_s']:.0f} MiB/s) | "
          f"{results['write_local_s']:.2f} s | {results['write_bare_pyarrow_s3_s']:.2f} s |")
    print(f"| one commit (one group) | {results['commit_s3_ms']:.1f} ms | {results['commit_local_ms']:.1f} ms | |")
    print(f"| open | {results['open_s3_ms']:.1f} ms | {results['open_local_ms']:.1f} ms | |")
    print(f"| loader epoch | {results['loader_epoch_s3_s']:.2f} s | {results['loader_epoch_local_s']:.2f} s | "
          f"{results['bare_scan_s3_s']:.2f} s (scan) |")


if __name__ == "__main__":
    main()

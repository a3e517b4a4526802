"""Per-rank reads of the loader: bytes each rank reads, and the time to open a dataset of many row groups.

    .venv/bin/python tests/bench/bench_loader_ranks.py [--groups 1200] [--row-groups 10000] [--json]

1. Bytes read per rank, for world sizes 1, 2, 4 and 8 (ranks simulated one after the other in
   this process, no sync callback), as a fraction of the dataset's bytes on disk: every byte read
   through the dataset's filesystem while a rank's loader opens and runs one epoch (a counting
   wrapper around pyarrow's local filesystem: footers, column chunks and the checksum reads), with the
   data checks on (per-block sha256 of the bytes read, and each shard's footer: manifest version 3) and
   off, and the loader's own count of the column chunks it decoded (``read_stats``). The goal: at most
   1.2 / world size. Also the groups each rank trains on, the groups of the epoch no rank uses (left
   over: the tail, under world size x groups_per_step) and the remainder blocks sliced among the ranks.
2. Open time of a dataset of ``--row-groups`` row groups (tiny ones, 100 to a shard): the loader's
   constructor on the manifest's row groups (manifest version 2: no row group read) and on the same
   dataset with the row groups stripped from its manifests (version 1: the ``group_id`` scan), best of 3.

Rows come from store/synthetic.py as in bench_loader.py (groups of 8, responses 100-4,000 tokens),
in row groups of 2 MB and shards of 16 MB.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.store.range_fs
from bench_loader import BASE_GROUPS, GROUP_SIZE, best_of, make_dataset  # noqa: E402

from rollshard.store.io.dataset import RolloutDataset  # noqa: E402
from rollshard.store.loader import LoaderConfig, RolloutLoader  # noqa: E402
from rollshard.store.io.storage import Storage  # noqa: E402
from rollshard.store.synthetic import synthetic_table  # noqa: E402
from rollshard.store.io.writer import ShardWriter, WriterOptions  # noqa: E402
from tests.store.range_fs import RangeFS  # noqa: E402

WORLD_SIZES = (1, 2, 4, 8)


def rank_bytes(root: Path, config: LoaderConfig, rank: int, world_size: int) -> dict:
    fs = RangeFS()
    ds = RolloutDataset.open(Storage(str(root), filesystem=fs))
    with RolloutLoader(ds, config, rank=rank, world_size=world_size) as loader:
        groups = sum(len(s.group_ids) for s in loader)
        stats = loader.epoch_stats
        return {"bytes": fs.total(), "decoded": loader.read_stats["bytes"], "groups": groups,
                "left": stats.get("left_groups", 0) + stats.get("tail_dropped_groups", 0)}


def bytes_bench(tmp: Path, args) -> dict:
    opts = WriterOptions(row_group_bytes=2 << 20, shard_bytes=16 << 20)
    ds = make_dataset(tmp / "data", args.groups, synthetic_table(BASE_GROUPS, GROUP_SIZE, seed=0), opts)
    blocks = sum(ds.footer(i).num_row_groups for i in range(len(ds.shards)))
    total = ds.num_bytes
    decoded_all = None
    out = {"groups": ds.num_groups, "shards": len(ds.shards), "row_groups": blocks, "bytes": total, "runs": [],
           "groups_per_step": LoaderConfig().groups_per_step}
    for verify in (True, False):
        config = LoaderConfig(shuffle_window=256, verify_data=verify)
        for w in WORLD_SIZES:
            ranks = [rank_bytes(tmp / "data", config, r, w) for r in range(w)]
            if w == 1 and verify:
                decoded_all = ranks[0]["decoded"]
            out["runs"].append({
                "verify_data": verify, "world_size": w,
                "max_fraction": max(r["bytes"] for r in ranks) / total,
                "mean_fraction": sum(r["bytes"] for r in ranks) / w / total,
                "max_decoded_fraction": max(r["decoded"] for r in ranks) / decoded_all,
                "groups_per_rank": [r["groups"] for r in ranks],
                "left_groups": sum(r["left"] for r in ranks),
                "remainder_blocks": RolloutLoader(ds, config, rank=0, world_size=w)._stream.plan(0).remainder_blocks,
            })
    return out


def strip_row_groups(root: Path) -> None:
    for path in (root / "_manifests").glob("*.json"):
        doc = json.loads(path.read_text())
        for entry in doc["shards"]:
            entry.pop("row_groups", None)
        doc["manifest_version"] = 1
        path.write_text(json.dumps(doc))


def open_bench(tmp: Path, args) -> dict:
    root = tmp / "many"
    table = synthetic_table(200, 2, seed=1, prompt_len=(2, 6), response_len=(1, 12))
    groups = [table.slice(i, 2) for i in range(0, table.num_rows, 2)]
    with ShardWriter(root, writer_id="many", options=WriterOptions(row_group_bytes=1 << 30)) as w:
        for k in range(args.row_groups):
            g = groups[k % len(groups)]
            for col in ("sample_id", "prompt_id", "group_id"):
                i = g.schema.get_field_index(col)
                g = g.set_column(i, col, [[f"r{k}-{v}" for v in g.column(col).to_pylist()]])
            w.write_group(g)
            w.flush()  # one group a row group
            if k % 100 == 99:
                w.commit()
    config = LoaderConfig()
    out = {"row_groups": args.row_groups, "shards": len(RolloutDataset.open(root).shards)}
    out["dataset_open_s"] = best_of(3, lambda: RolloutDataset.open(root))[0]
    ds = RolloutDataset.open(root)
    out["loader_open_manifest_s"] = best_of(3, lambda: RolloutLoader(ds, config).close())[0]
    strip_row_groups(root)
    old = RolloutDataset.open(root)
    out["loader_open_scan_s"] = best_of(3, lambda: RolloutLoader(old, config).close())[0]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=1200)
    p.add_argument("--row-groups", type=int, default=10_000)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"bytes_per_rank": bytes_bench(Path(tmp), args), "open": open_bench(Path(tmp), args)}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    b = result["bytes_per_rank"]
    print(f"{b['groups']} groups, {b['shards']} shards, {b['row_groups']} row groups, {b['bytes'] / 2**20:.0f} MiB; "
          "one epoch per rank\n")
    print("| data checks | world size | bytes read, max rank | mean rank | goal 1.2/W | decoded, max rank | "
          "groups per rank | left over (tail < W x groups_per_step) | remainder blocks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in b["runs"]:
        w = r["world_size"]
        print(f"| {'on' if r['verify_data'] else 'off'} | {w} | {r['max_fraction']:.3f} | {r['mean_fraction']:.3f} | "
              f"{1.2 / w:.3f} | {r['max_decoded_fraction']:.3f} | {', '.join(map(str, r['groups_per_rank']))} | "
              f"{int(r['left_groups'])} (< {w * b['groups_per_step']}) | {r['remainder_blocks']} |")
    o = result["open"]
    print(f"\nopen of {o['row_groups']} row groups in {o['shards']} shards, best of 3: RolloutDataset.open "
          f"{o['dataset_open_s']:.3f} s; RolloutLoader on the manifest's row groups {o['loader_open_manifest_s']:.3f} s, "
          f"with the group_id scan (old manifest) {o['loader_open_scan_s']:.3f} s")


if __name__ == "__main__":
    main()

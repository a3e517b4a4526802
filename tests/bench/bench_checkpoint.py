"""Checkpoint benchmark: formats 3 and 2 (sharded, DCP safetensors storage) against format 1 (gathered to rank 0).

    .venv/bin/python tests/bench/bench_checkpoint.py [--hidden 1024] [--layers 24] [--nprocs 1,2] [--repeat 1]
                                                     [--formats v1,v2,v2-dcp,v3,v3-model] [--json]

Builds a GPT-2 of ``--hidden`` x ``--layers`` locally (random fp32 weights, the tiny preset's
tokenizer and its 1024-token vocabulary; default 1024 x 24: 0.30 B parameters, 1.2 GB fp32). For
each world size in ``--nprocs`` and each format, two fresh torchrun launches of this file (gloo on
CPU, FSDP2 for 2+ processes), so that no measurement reuses memory another one freed:

* save: the ``hf`` backend, one AdamW update (so the moments exist), then the save. Wall time of
  the whole save (fsyncs included), bytes on disk per rank (format 1 has one writer) and in total
  (model folder + state), and rank 0's peak RSS during the save, also as the rise over its RSS just
  before (``malloc_trim``, then ``VmHWM`` reset through ``/proc/self/clear_refs``);
* load: a backend built as a resume builds it (formats 1 and 3: from the checkpoint's model folder;
  format 2: from ``--model``, the same cost), then the checkpoint's state put in (format 1: the
  whole optimizer file read on every rank, then set; format 2: weights and moments from the rank's
  own shards; format 3: the moments from them); wall time and rank 0's peak RSS of that step. RSS counts the
  file pages safetensors maps while reading (page cache, reclaimable) as well as allocations.

Format 1 is written by the frozen copy of its writer (tests/train/v1_checkpoint.py) plus the same
fsyncs; formats 2 and 3 by ``rollshard.train.checkpoint.save_checkpoint``: format 3 (what it writes now) keeps the
weights in the model folder only and builds a resume's model from it, format 2 (written here by telling the backend
its export is not its weights, ``exports_held_weights``) keeps them in the shards as well and loads them from
there. Format 2 is measured twice: as rollshard writes it (each rank's files streamed a tensor at a time,
``rollshard.train.sharded.write_shards``) and with the same files written by DCP's ``HuggingFaceStorageWriter``
(``dcp.save``, what every rank used before). Format 3 is also measured model-only (``v3-model``: no AdamW state, what
``--final-checkpoint model`` writes at a run's end and ``rollshard-loop``'s rounds use; its load is the model's
build alone). Prints a markdown table
(``--json``: the figures as JSON). ``--repeat N``: the fastest save of N (with its load).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.train.v1_checkpoint


def rss_mib(field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def build_model(root: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollshard.generate.models import init_model

    tiny = init_model(root / "tiny", preset="tiny-gpt2", seed=0)
    cfg = AutoConfig.from_pretrained(tiny)
    cfg.n_embd, cfg.n_layer, cfg.n_head = hidden, layers, max(hidden // 64, 1)
    torch.manual_seed(0)
    path = root / f"gpt2-{hidden}x{layers}"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    for f in tiny.iterdir():  # tokenizer, chat template, generation config
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, path / f.name)
    return path


def worker(op: str, fmt: str, model: str, out: str) -> None:
    """One measurement in this fresh process: ``save`` (backend, one update, save) or ``load`` (a resumed
    backend's state put in from the checkpoint the save left)."""
    import torch

    from rollshard.train.backends.distributed import close_distributed, init_distributed
    from rollshard.train.backends.hf import HFBackend
    from rollshard.train.checkpoint import fsync_tree, latest_checkpoint, save_checkpoint
    from rollshard.train.config import ModelConfig, OptimConfig
    from rollshard.train.trainer import dummy_batch
    from tests.train import v1_checkpoint

    env = init_distributed()
    root = Path(out) / fmt
    if fmt in ("v2", "v2-dcp"):  # the weights in the shards too
        HFBackend.exports_held_weights = False
    if fmt == "v2-dcp":  # the same files through DCP's safetensors storage
        import rollshard.train.sharded as sharded

        sharded.write_shards = sharded.write_with_dcp
    ckpt = latest_checkpoint(root) if op == "load" else None
    b = HFBackend(ModelConfig(path=model), OptimConfig(), env=env, total_updates=None,
                  weights_from=ckpt.weights_from if ckpt else None)
    if op == "save":
        batch = dummy_batch()
        batch.input_ids[:] = torch.tensor([5, 9])
        logp, _ = b.logprobs(batch, grad=True)
        b.backward(-logp.sum())
        b.optimizer_step()

    def save() -> None:
        if fmt == "v1":
            final = v1_checkpoint.save_v1(root, step=1, backend=b, loader_states=[{}], weight_version="1",
                                          world_size=env.world_size, is_main=env.is_main)
            if env.is_main:
                fsync_tree(final)
        else:
            save_checkpoint(root, step=1, backend=b, loader_states=[{}], weight_version="1", env=env,
                            config_yaml="trainer: {}\n", keep_last=1, optimizer=fmt != "v3-model")

    env.barrier()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS, so the rise is this operation's
    before = rss_mib("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    save() if op == "save" else ckpt.restore(b)
    env.barrier()
    seconds = time.perf_counter() - t0
    peak = rss_mib("VmHWM")
    result = {"s": seconds, "rank0_peak_rss_mib": peak, "rank0_rss_rise_mib": peak - before}
    if op == "save" and env.is_main:
        path = latest_checkpoint(root).path
        files = [f for f in path.rglob("*") if f.is_file()]
        state = [f for f in files if f.parent != path]
        per_rank: dict[str, int] = {}
        for f in state:
            if f.suffix == ".safetensors":  # shards/shard-0000R-...: rank R - 1's; optimizer/: rank 0's
                key = f.name.split("-")[1] if f.name.startswith("shard-") else "00001"
                per_rank[key] = per_rank.get(key, 0) + f.stat().st_size
        result.update(
            parameters=sum(p.numel() for p in b.hf_model.parameters()),  # a DTensor's numel is the whole tensor's
            total_bytes=sum(f.stat().st_size for f in files),
            model_folder_bytes=sum(f.stat().st_size for f in files if f not in state),
            state_bytes_per_rank=[per_rank[k] for k in sorted(per_rank)],
            state_files=len(state),
        )
    if env.is_main:
        (Path(out) / f"{op}-{fmt}.json").write_text(json.dumps(result))
    close_distributed(env)


FORMATS = {"v1": "format 1", "v2": "format 2", "v2-dcp": "format 2, DCP writer", "v3": "format 3",
           "v3-model": "format 3, model only"}


def table(results: list[dict]) -> str:
    rows = [
        "| processes | format | save s | load s | rank 0 peak RSS in save, MiB (rise) | in load (rise) "
        "| state per rank, MB | checkpoint total, MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for fmt in FORMATS.values():
            if fmt not in r:
                continue
            f = r[fmt]
            per_rank = " / ".join(f"{n / 1e6:.0f}" for n in f["state_bytes_per_rank"])
            rows.append(
                f"| {r['world_size']} | {fmt} | {f['save']['s']:.2f} | {f['load']['s']:.2f} "
                f"| {f['save']['rank0_peak_rss_mib']:.0f} (+{f['save']['rank0_rss_rise_mib']:.0f}) "
                f"| {f['load']['rank0_peak_rss_mib']:.0f} (+{f['load']['rank0_rss_rise_mib']:.0f}) "
                f"| {per_rank} | {f['total_bytes'] / 1e6:.0f} |"
            )
    return "\n".join(rows)


RATIOS = (("dcp_writer_over_own_save", "format 2, DCP writer", "format 2"),
          ("format_2_over_format_3_save", "format 2", "format 3"),
          ("format_3_over_model_only_save", "format 3", "format 3, model only"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--nprocs", default="1,2", help="world sizes to run, comma-separated")
    ap.add_argument("--repeat", type=int, default=1, help="runs per measurement; the fastest is reported")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"formats to run, comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--worker", nargs=4, metavar=("OP", "FORMAT", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    torchrun = Path(sys.executable).with_name("torchrun")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        model = build_model(Path(tmp), args.hidden, args.layers)
        for n in (int(x) for x in args.nprocs.split(",")):
            result: dict = {"world_size": n}
            formats = [(f, FORMATS[f]) for f in args.formats.split(",")]
            best: dict = {name: {} for _, name in formats}
            rounds = []  # each round's save seconds by format: every format once a round, so load changes hit all
            for _ in range(args.repeat):
                rounds.append({})
                for fmt, name in formats:
                    out = Path(tmp) / f"world-{n}"
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    run = {}
                    for op in ("save", "load"):
                        cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(n), __file__,
                               "--worker", op, fmt, str(model), str(out)]
                        env = dict(os.environ, OMP_NUM_THREADS=str(max(os.cpu_count() // n, 1)))
                        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        run[op] = json.loads((out / f"{op}-{fmt}.json").read_text())
                    rounds[-1][name] = run["save"]["s"]
                    if not best[name] or run["save"]["s"] < best[name]["save"]["s"]:
                        best[name] = run
            sizes = ("total_bytes", "model_folder_bytes", "state_bytes_per_rank", "state_files")
            for _, name in formats:
                result[name] = {"save": best[name]["save"], "load": best[name]["load"],
                                **{k: best[name]["save"][k] for k in sizes}}
                result["parameters"] = best[name]["save"]["parameters"]
            result["save_s_rounds"] = rounds
            def over(slow: str, fast: str) -> dict:  # save time of ``slow`` over ``fast``: best, and per round
                return {"best": best[slow]["save"]["s"] / best[fast]["save"]["s"],
                        "rounds": [r[slow] / r[fast] for r in rounds]}

            # > 1: rollshard's own writer is faster than DCP's (the same files); format 3 (the weights once) is faster;
            # the model only is faster than the whole state
            for key, slow, fast in RATIOS:
                if slow in best and fast in best:
                    result[key] = over(slow, fast)
            results.append(result)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"GPT-2 {args.hidden} x {args.layers}: {results[0]['parameters'] / 1e9:.2f} B parameters\n")
        print(table(results))
        for r in results:
            for key, slow, fast in RATIOS:
                if key not in r:
                    continue
                ratio = r[key]
                print(f"{r['world_size']} process(es): {slow} takes {ratio['best']:.2f}x {fast}'s save time (best of "
                      f"{args.repeat}; per round {', '.join(f'{x:.2f}' for x in ratio['rounds'])})")


if __name__ == "__main__":
    main()

"""GPU check: the real SGLang server, the runner, one bf16 training step and the embedded engine on one GPU.

Set-up on a fresh GPU machine (the README's): ``pip install -e '.[dev]'`` into ``.venv`` without
``constraints/cpu.txt`` (the registry's CUDA torch), then ``bash scripts/make_sglang_env.sh`` (SGLang's own
venv). Then, in under 8 minutes on one GPU, printing one JSON object::

    .venv/bin/python tests/bench/gpu/check.py
    .venv/bin/python tests/bench/gpu/check.py --tiny --device cpu --server serve   # the same steps on a CPU

1. model: a random Qwen3-architecture model of ~0.5B parameters (28 layers x 1024 hidden, 16 query and 8
   key/value heads of 128, MLP 3072; Qwen3-0.6B's shape but for the vocabulary) from a config, with the
   locally trained tokenizer of ``rollshard-generate init-model`` (nothing downloaded), saved in bf16.
   ``--tiny``: the tiny-qwen3 test model instead.
2. server: the real SGLang server on the GPU (bf16; ``--server serve``: ``rollshard-generate serve``).
3. generate: ``rollshard-generate``'s runner (single agent, math task, logprobs, Parquet writer) against the
   bare SGLang client over the same number of requests: tokens/s and their ratio (target >= 0.95).
4. train: one hf-backend step, bf16 autocast with the fp32 head, on the rows of 3: step-0 |logp -
   rollout_logp| mean and max (the trainer's logprobs against SGLang's bf16 ones), ratio mean.
5. embedded: the embedded engine (fp32) on the device against transformers ``generate()`` (static batch),
   the equal and mixed workloads of ``tests/bench/bench_engines.py``.
6. async: ``rollshard-loop --async`` against the server of 2 (``--async-steps`` steps at eta 1, a checkpoint
   pushed every 2 steps): steps per hour, rows generated and trained, the staleness of the trained rows and the
   trainer's busy share (``--steps async`` alone runs it with a server of its own).
7. moe: routing replay (R3) end to end on a random Qwen3-MoE (8 layers x 1024 hidden, top-4 of 32 experts of
   512, ~0.45B parameters, bf16; ``--tiny``: tiny-qwen3-moe): the server started with
   ``--enable-return-routed-experts``, ``rollshard-generate --routed-experts on`` (routing stored, its column's
   bytes per position), ``rollshard-train audit`` (the routing agreement and |logp - rollout_logp| with and
   without replay) and one replayed training step (``--routing-replay on``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "bench"))  # bench_engines, bench_generate: the same measurements

# A Qwen3-MoE of ~0.45B parameters (the MoE step): Qwen3-30B-A3B's router (softmax top-k, renormalized) at a small size.
QWEN3_MOE = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=512,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    max_position_embeddings=4096,
)
# Qwen3-0.6B's shape with the local 1024-token vocabulary: ~0.44B parameters.
QWEN3_HALF_B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
)
SGLANG_STARTUP_S = 420  # import, weights, CUDA graphs; a first start on a fresh machine compiles kernels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny-qwen3 test model instead of the ~0.5B one")
    ap.add_argument("--device", default="cuda", help="torch device of the training step and the embedded engine")
    ap.add_argument("--server", choices=["sglang", "serve"], default="sglang", help="the server of steps 2-4")
    ap.add_argument("--steps", default="generate,train,embedded,async,moe",
                    help="comma-separated steps to run after the model")
    ap.add_argument("--async-steps", type=int, default=8, help="async step: optimizer steps of the run")
    ap.add_argument("--prompts", type=int, default=64, help="prompts of the generate step (x --n-samples requests)")
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32, help="embedded step: generate()'s batch and the engine's rows")
    ap.add_argument("--new-tokens", type=int, default=128, help="embedded step: new tokens of the equal workload")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the generate and embedded comparisons")
    ap.add_argument("--sglang-args", default="", help="extra arguments for sglang.launch_server, one string")
    ap.add_argument("--out", type=Path, default=None, help="working folder (default: a new temporary one)")
    args = ap.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(args.steps) - {"generate", "train", "embedded", "async", "moe"})
    if unknown:
        ap.error(f"unknown step(s) {unknown}; steps are generate, train, embedded, async, moe")
    if "train" in args.steps and "generate" not in args.steps:
        ap.error("the train step trains on the generate step's rows: keep generate in --steps")
    if min(args.prompts, args.n_samples, args.concurrency, args.max_new_tokens, args.batch, args.repeat) < 1:
        ap.error("--prompts, --n-samples, --concurrency, --max-new-tokens, --batch and --repeat must be >= 1")
    return args


def build_model(root: Path, tiny: bool, device: str) -> tuple[Path, int]:
    """(model folder, parameters): tiny-qwen3, or its tokenizer under the ~0.5B config; weights in bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollshard.generate.models import init_model

    base = init_model(root / "tiny-qwen3", preset="tiny-qwen3", seed=0)
    if tiny:
        return base, _params(base)
    cfg = half_b_config(base)
    torch.manual_seed(0)
    with torch.device(device):  # initializing 0.44B parameters on a CPU takes a while
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return save_with_tokenizer(model, base, root / "qwen3-0.5b"), sum(p.numel() for p in model.parameters())


def save_with_tokenizer(model, base: Path, path: Path) -> Path:
    """``model`` saved at ``path`` with ``base``'s tokenizer, chat template and generation config."""
    model.save_pretrained(path)
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (path / f.name).write_bytes(f.read_bytes())
    cfg_file = path / "config.json"
    cfg_json = json.loads(cfg_file.read_text())
    cfg_json.setdefault("torch_dtype", cfg_json.get("dtype", "bfloat16"))  # what the SGLang venv's transformers reads
    cfg_file.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    return path


def half_b_config(base: Path):
    """tiny-qwen3's config (tokenizer ids, tied embeddings) at the ~0.5B shape."""
    from transformers import AutoConfig

    d = {**AutoConfig.from_pretrained(base).to_dict(), **QWEN3_HALF_B}
    d.pop("layer_types", None)  # one per layer: derived again for 28 layers
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _params(path: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())


def build_moe_model(root: Path, tiny: bool, device: str) -> Path:
    """tiny-qwen3-moe, or its tokenizer under :data:`QWEN3_MOE`; weights in bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollshard.generate.models import init_model

    base = init_model(root / "tiny-qwen3-moe", preset="tiny-qwen3-moe", seed=0)
    if tiny:
        return base
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(moe_config(base), dtype=torch.bfloat16)
    return save_with_tokenizer(model, base, root / "qwen3-moe")


def moe_config(base: Path):
    """tiny-qwen3-moe's config (tokenizer ids, tied embeddings) at :data:`QWEN3_MOE`."""
    from transformers import AutoConfig

    d = AutoConfig.from_pretrained(base).to_dict()
    d.pop("num_local_experts", None)  # transformers 5's name of num_experts: it would win over ours
    d = {**d, **QWEN3_MOE}
    d.pop("layer_types", None)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def run_command(cmd: list[str]) -> subprocess.CompletedProcess:
    """A command to its end, its output captured (the CPU test runs each ``-m`` command as a fork of a warm server,
    tests/forked.py)."""
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)


def start_command(cmd: list[str], log: Path) -> subprocess.Popen:
    """A server started in a session of its own (:func:`stop_server` stops its whole group), its output to ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def step_moe(args, url: str, model: Path, root: Path) -> dict:
    """Routing stored by the server, audited both ways, and one replayed training step."""
    import pyarrow.parquet as pq
    import torch

    data, out = root / "moe-data", {}
    gen = run_command(
        [sys.executable, "-m", "rollshard.generate", "--engine", url, "--task", "math", "--limit", str(args.prompts),
         "--n-samples", str(args.n_samples), "--max-new-tokens", str(args.max_new_tokens), "--routed-experts", "on",
         "--concurrency", str(args.concurrency), "--out", str(data), "--no-progress"])
    if gen.returncode != 0:
        return {"exit": gen.returncode, "stderr": gen.stderr[-2000:]}
    stored = positions = 0
    shape = None
    for f in sorted((data / "shards").glob("*.parquet")):
        pf = pq.ParquetFile(f)
        shape = json.loads(pf.schema_arrow.metadata[b"rollshard.config"])["routed_experts"]
        for rg in range(pf.metadata.num_row_groups):
            meta = pf.metadata.row_group(rg)
            stored += sum(meta.column(c).total_compressed_size for c in range(meta.num_columns)
                          if meta.column(c).path_in_schema == "routed_experts")
        t = pf.read(columns=["prompt_tokens", "response_tokens"])
        positions += sum(len(p) + len(r) - 1 for p, r in zip(t.column(0).to_pylist(), t.column(1).to_pylist()))
    if not positions:
        return {"rows": 0, "stderr": gen.stderr[-2000:]}
    out["routing"] = shape
    out["column_bytes_per_position"] = round(stored / positions, 2)
    out["layers_x_top_k"] = shape["layers"] * shape["top_k"]
    audit = run_command(
        [sys.executable, "-m", "rollshard.train", "audit", "--data", str(data), "--model", str(model), "--device",
         args.device, "--json", "--no-progress", "--max-abs-diff", "100"])
    if audit.returncode != 0:
        return {**out, "audit_exit": audit.returncode, "stderr": audit.stderr[-2000:]}
    out["audit"] = json.loads(audit.stdout)["routing"]
    bf16 = args.device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    train = run_command(
        [sys.executable, "-m", "rollshard.train", "--data", str(data), "--model", str(model), "--out",
         str(root / "moe-train"), "--max-steps", "1", "--groups-per-step", str(args.prompts), "--routing-replay", "on",
         "--lr", "1e-6", "--no-progress", "--no-tensorboard", "--dtype", "bfloat16" if bf16 else "float32"])
    if train.returncode != 0:
        return {**out, "train_exit": train.returncode, "stderr": train.stderr[-2000:]}
    m0 = json.loads((root / "moe-train" / "metrics.jsonl").read_text().splitlines()[0])
    out["train"] = {k: m0.get(k) for k in ("routing/agreement", "mismatch/abs_diff_mean", "mismatch/abs_diff_max",
                                           "ratio/mean", "optim/grad_norm")}
    return out


def start_server(args, model: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, str, float]:
    """(process, URL, start-up seconds) of the real SGLang server on the GPU, or of ``rollshard-generate serve``."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.server == "sglang":
        script = ["bash", str(REPO / "scripts" / "make_sglang_env.sh"), "--path"]
        venv = Path(subprocess.run(script, capture_output=True, text=True, check=True).stdout.strip())
        python = venv / "bin" / "python"
        if not python.is_file():
            raise SystemExit(f"check.py: error: no SGLang environment at {venv}; build it with scripts/make_sglang_env.sh")
        cmd = [
            str(python), "-m", "sglang.launch_server", "--model-path", str(model), "--dtype", "bfloat16",
            "--mem-fraction-static", "0.4", "--host", "127.0.0.1", "--port", str(port), *args.sglang_args.split(),
            *extra,
        ]  # fmt: skip
    else:
        cmd = [
            sys.executable, "-m", "rollshard.generate", "serve", "--model", str(model), "--port", str(port),
            "--device", args.device, "--max-batch-size", str(args.batch), *extra,
        ]  # fmt: skip
    t0 = time.perf_counter()
    proc = start_command(cmd, log)
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < SGLANG_STARTUP_S:
        if proc.poll() is not None:
            raise SystemExit(f"check.py: error: the {args.server} server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url, time.perf_counter() - t0
        except OSError:
            time.sleep(1.0)
    stop_server(proc)
    raise SystemExit(f"check.py: error: the {args.server} server did not start in {SGLANG_STARTUP_S} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: SGLang's scheduler and detokenizer too
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def step_generate(args, url: str, model: Path, root: Path) -> dict:
    """The runner against the bare client, the same requests, in turn; the last runner dataset is kept."""
    import bench_generate

    from rollshard.generate.tasks import Prompt, get_task
    from rollshard.store.models.tokenizer import apply_chat_template, load_tokenizer

    task = get_task("math")
    prompts = [
        Prompt(prompt_id=f"q{i:05d}", index=i, content=f"What is {i} + {2 * i}?", label=str(3 * i))
        for i in range(args.prompts)
    ]
    tok = load_tokenizer(model)
    ids = [apply_chat_template(tok, task.messages(q)) for q in prompts]
    bench_args = argparse.Namespace(
        agents="single", n_samples=args.n_samples, concurrency=args.concurrency, tokens=args.max_new_tokens
    )
    runner_rates, bare_rates, failed = [], [], 0
    for r in range(args.repeat):
        result = asyncio.run(bench_generate.runner(url, model, prompts, root / f"data-{r}", bench_args))
        failed += len(result.failed)
        runner_rates.append(result.response_tokens / result.seconds)
        seconds, tokens = asyncio.run(
            bench_generate.bare(url, ids, result.rows, args.concurrency, args.max_new_tokens)
        )
        bare_rates.append(tokens / seconds)
    ratios = sorted(a / b for a, b in zip(runner_rates, bare_rates))
    return {
        "requests": result.rows,
        "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens,
        "runner_tok_s": round(statistics.median(runner_rates)),
        "bare_tok_s": round(statistics.median(bare_rates)),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
        "failed": failed,
        "data": str(root / f"data-{args.repeat - 1}"),
    }


def step_train(args, model: Path, data: Path, root: Path) -> dict:
    """One hf-backend step, bf16 autocast where the device has it, fp32 head: the step-0 mismatch metrics."""
    import torch

    from rollshard.train.config import TrainConfig
    from rollshard.train.trainer import Trainer

    bf16 = args.device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    config = TrainConfig.from_dict(
        {
            "data": {"path": str(data), "groups_per_step": args.prompts, "micro_batch_tokens": 16384,
                     "num_epochs": None},
            "model": {"path": str(model), "backend": "hf", "dtype": "bfloat16" if bf16 else "float32",
                      "fp32_lm_head": True},
            "optim": {"lr": 1e-6},
            "trainer": {"out": str(root / "train"), "max_steps": 1, "progress": False, "tensorboard": False},
        }
    ).validate()
    t0 = time.perf_counter()
    trainer = Trainer(config)
    try:
        history = trainer.run()
    finally:
        trainer.close()
    m0 = history[0]
    return {
        "dtype": config.model.dtype,
        "fp32_lm_head": config.model.fp32_lm_head,
        "attn_implementation": config.model.attn_implementation,
        "abs_diff_mean": m0["mismatch/abs_diff_mean"],
        "abs_diff_max": m0["mismatch/abs_diff_max"],
        "ratio_mean": m0["ratio/mean"],
        "tokens": m0.get("perf/tokens", None),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def step_async(args, url: str, model: Path, root: Path) -> dict:
    """``rollshard-loop --async`` with the server as its engine: the run's figures (its timeline left out)."""
    import torch

    bf16 = args.device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    train = f"--groups-per-step 8 --lr 1e-6 --no-tensorboard --micro-batch-tokens 16384{' --dtype bfloat16' if bf16 else ''}"
    command = [
        sys.executable, "-m", "rollshard.train.loop", "--async", "--engine", url, "--model", str(model),
        "--out", str(root / "async"), "--steps", str(args.async_steps), "--max-staleness", "1", "--update-every", "2",
        "--no-progress", "--no-report", "--json",
        "--generate", f"--task math --n-samples {args.n_samples} --max-new-tokens {args.max_new_tokens}",
        "--train", train,
    ]  # fmt: skip
    done = run_command(command)
    if done.returncode != 0:
        return {"exit": done.returncode, "stderr": done.stderr[-2000:]}
    figures = json.loads(done.stdout)["async"]
    figures.pop("timeline", None)
    return figures


def step_embedded(args, model_path: Path) -> dict:
    """The embedded engine against generate() on the device, in turn (bench_engines' workloads)."""
    import bench_engines
    import torch

    from rollshard.generate.engines import SamplingParams
    from rollshard.generate.engines.embedded import EmbeddedEngine, load_causal_lm

    model = load_causal_lm(model_path, args.device)
    engine = EmbeddedEngine(model_path, device=args.device, max_batch_size=args.batch)
    pad = engine.tokenizer.pad_token_id or 0
    asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4), ignore_eos=True))  # warm up
    bench_engines.run_generate(model, [([1, 2, 3], 4)], 1, pad, device=args.device)
    out = {}
    for wl in ("equal", "mixed"):
        requests = bench_engines.workload(wl, args.batch, args.new_tokens)
        gen, emb = [], []
        for _ in range(args.repeat):
            seconds, tokens = bench_engines.run_generate(model, requests, args.batch, pad, device=args.device)
            gen.append(tokens / seconds)
            seconds, tokens = asyncio.run(bench_engines.run_embedded(engine, requests))
            emb.append(tokens / seconds)
        ratios = sorted(e / g for e, g in zip(emb, gen))
        out[wl] = {
            "generate_tok_s": round(statistics.median(gen)),
            "embedded_tok_s": round(statistics.median(emb)),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
        }
    asyncio.run(engine.close())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("check.py: error: no CUDA device; on a CPU pass --tiny --device cpu --server serve")
    t_start = time.perf_counter()
    root = args.out or Path(tempfile.mkdtemp(prefix="rollshard-gpu-check-"))
    root.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "server": args.server,
    }
    t0 = time.perf_counter()
    model, params = build_model(root, args.tiny, args.device)
    report["model"] = {"path": str(model), "params": params, "build_s": round(time.perf_counter() - t0, 1)}
    if "generate" in args.steps:
        proc, url, startup = start_server(args, model, root / f"{args.server}.log")
        try:
            report["server_startup_s"] = round(startup, 1)
            report["generate"] = step_generate(args, url, model, root)
        finally:
            stop_server(proc)  # its memory back before the training step
    if "train" in args.steps:
        report["train"] = step_train(args, model, Path(report["generate"]["data"]), root)
    if "embedded" in args.steps:
        report["embedded"] = step_embedded(args, model)
    if "async" in args.steps:
        proc, url, _ = start_server(args, model, root / f"{args.server}-async.log")
        try:
            report["async"] = step_async(args, url, model, root)
        finally:
            stop_server(proc)
    if "moe" in args.steps:
        moe = build_moe_model(root, args.tiny, args.device)
        proc, url, _ = start_server(args, moe, root / f"{args.server}-moe.log", "--enable-return-routed-experts")
        try:
            report["moe"] = step_moe(args, url, moe, root)
        finally:
            stop_server(proc)
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

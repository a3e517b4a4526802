"""Engine benchmarks: the SGLang client against its C/L ceiling; the embedded engine against what users run instead.

    .venv/bin/python tests/bench/bench_engines.py [--only client|engines] [--client-repeat 3] [--models tiny,26m] [--repeat 3]
                                                  [--workloads equal,mixed] [--sglang] [--threads N] [--json]

(a) client: the SGLang client against a stand-in server (a subprocess, so its CPU is not
    counted) that answers every ``/generate`` after a fixed latency L with a canned
    response of ``--tokens`` tokens and logprobs. With C requests in flight the
    ceiling is C / L requests per second; the client should reach >= 95% of it. Beside it, in
    turn against the same server (``--client-repeat`` rounds), a bare aiohttp session that parses
    nothing: what any aiohttp client reaches against this server on this machine. Both open one
    connection per slot before the clock starts (a run keeps its connections). Client CPU time is
    reported per 1,000 response tokens (JSON decode + strict validation).
(b) engines: on one model, the same requests through
    * ``generate``: plain transformers ``generate()``, static batches of ``--batch`` in arrival order
      (left-padded, each batch run to its longest request), sampling at temperature 1 over the whole
      vocabulary, eos off;
    * ``embedded``: the embedded engine in this process, continuous batching at ``--batch`` rows;
    * ``serve``: ``rollshard-generate serve`` (a subprocess) over HTTP, logprobs on, same batch size;
    * ``sglang`` (with ``--sglang``): the real SGLang CPU server of ``scripts/make_sglang_env.sh``, fp32,
      torch_native attention, ``--max-running-requests`` = ``--batch``, over HTTP like ``serve``;
    all with ``ignore_eos``, so every request runs to its own max_new_tokens. Workloads: ``equal``,
    ``--batch`` requests of 32 prompt tokens and ``--new-tokens`` new ones; ``mixed``, 4 x ``--batch``
    requests of 8-64 prompt tokens and 16-256 new ones (seeded). Figure: response tokens per second
    (``generate()``'s padding steps count as nothing). The engines run in turn, ``--repeat`` rounds, in one
    process, so a busy machine slows them alike; ratios are per round, the median given with the range.
    While one engine runs, the servers of the others are paused (SIGSTOP: SGLang's scheduler polls a core
    even when idle).
    Models: ``tiny`` (the test GPT-2, 64 hidden x 2 layers), ``26m`` (GPT-2, 512 x 8 layers, 26.3M
    parameters, the same tokenizer, random weights) and ``smollm2`` (SmolLM2-135M-Instruct, fp32, from
    ``init-model --preset smollm2-135m-instruct``; SGLang's CPU server is not tried on it). Without
    ``--threads`` the embedded engine runs at its own default thread count (see generate/engines/embedded.py)
    and the rest at torch's. For the decode step alone, profiled, see tests/bench/bench_decode.py.
Prints markdown tables, or with ``--json`` one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from rollshard.generate.engines import SamplingParams
from rollshard.generate.engines.sglang import SGLangConfig, SGLangEngine

REPO = Path(__file__).resolve().parents[2]


def serve_canned(latency: float, tokens: int) -> None:
    """The stand-in server: ``--serve-canned``; prints its port, answers after ``latency`` seconds."""
    body = json.dumps(
        {
            "text": "x" * tokens,
            "output_ids": [i % 1000 for i in range(tokens)],
            "meta_info": {
                "id": "bench",
                "finish_reason": {"type": "length", "length": tokens},
                "prompt_tokens": 64,
                "completion_tokens": tokens,
                "cached_tokens": 0,
                "weight_version": "0",
                "weight_versions": [{"version": "0", "start": 0, "end": tokens}],
                "output_token_logprobs": [[-1.0 - (i % 97) / 100, i % 1000, None] for i in range(tokens)],
                "e2e_latency": latency,
            },
        }
    ).encode()

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(latency)
        return web.Response(body=body, content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.add_routes([web.post("/generate", generate)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop  # optional: a faster server loop makes the ceiling easier to reach

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())


async def client_run(url: str, concurrency: int, n_requests: int) -> tuple[float, float, int]:
    """Returns (wall seconds, client CPU seconds, response tokens) for n_requests at a fixed concurrency."""
    eng = SGLangEngine(url, config=SGLangConfig(max_concurrency=concurrency))
    prompt = list(range(64))
    sp = SamplingParams(max_new_tokens=256)
    # Warm one connection per slot: a run keeps its connections for minutes; opening them is not the steady state.
    await asyncio.gather(*(eng.generate(prompt, sp) for _ in range(concurrency)))
    queue = iter(range(n_requests))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        for _ in queue:
            res = await eng.generate(prompt, sp)
            tokens += len(res.output_ids)

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await eng.close()
    return wall, cpu, tokens


async def bare_run(url: str, concurrency: int, n_requests: int) -> tuple[float, float, int]:
    """The floor of any aiohttp client: the same requests through a bare session that parses nothing."""
    body = json.dumps(
        {"input_ids": list(range(64)), "sampling_params": {"max_new_tokens": 256}, "return_logprob": True}
    ).encode()
    connector = aiohttp.TCPConnector(limit=concurrency + 16, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> int:
            async with session.post(url + "/generate", data=body, headers={"Content-Type": "application/json"}) as r:
                return len(await r.read())

        await asyncio.gather(*(one() for _ in range(concurrency)))
        queue = iter(range(n_requests))

        async def worker() -> None:
            for _ in queue:
                await one()

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, time.process_time() - cpu0, 0


CLIENT_CASES = [(32, 0.1), (256, 1.0), (512, 2.0)]  # a stress case (many requests/s), then SGLang-like latencies


def bench_client(args) -> list[dict]:
    """Per case one stand-in server; the bare session and the client in turn, ``--client-repeat`` rounds each, so a
    busy machine slows both alike; medians, and the client's ratio to the bare session per round."""
    figures = []
    for concurrency, latency in CLIENT_CASES:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-canned", str(latency), "--tokens", str(args.tokens)],
            stdout=subprocess.PIPE,
            text=True,
        )
        ceiling = concurrency / latency
        n = concurrency * args.requests_per_slot
        bare, client, cpu_ms = [], [], []
        try:
            url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
            for _ in range(args.client_repeat):
                wall, _, _ = asyncio.run(bare_run(url, concurrency, n))
                bare.append(n / wall / ceiling)
                wall, cpu, tokens = asyncio.run(client_run(url, concurrency, n))
                client.append(n / wall / ceiling)
                cpu_ms.append(1000 * cpu / tokens * 1000)
        finally:
            proc.terminate()
            proc.wait()
        figures.append(
            {
                "concurrency": concurrency,
                "latency_ms": round(latency * 1000),
                "ceiling_req_s": round(ceiling),
                "achieved_req_s": round(statistics.median(client) * ceiling),
                "ratio": round(statistics.median(client), 3),
                "ratio_range": [round(min(client), 3), round(max(client), 3)],
                "bare_ratio": round(statistics.median(bare), 3),
                "client_over_bare": round(statistics.median(c / b for c, b in zip(client, bare)), 3),
                "client_cpu_ms_per_1k_tokens": round(statistics.median(cpu_ms), 2),
                "server_loop": "uvloop" if _has_uvloop() else "asyncio",
            }
        )
    return figures


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def client_table(figures: list[dict]) -> list[str]:
    rows = [
        "| in flight C | latency L | ceiling C/L req/s | achieved req/s | ratio (range) | bare aiohttp ratio | "
        "client / bare | client CPU ms / 1k tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        lo, hi = f["ratio_range"]
        rows.append(
            f"| {f['concurrency']} | {f['latency_ms']} ms | {f['ceiling_req_s']} | {f['achieved_req_s']} | "
            f"{f['ratio']:.3f} ({lo:.3f}-{hi:.3f}) | {f['bare_ratio']:.3f} | {f['client_over_bare']:.3f} | "
            f"{f['client_cpu_ms_per_1k_tokens']:.2f} |"
        )
    return rows


# ---- (b) engines: embedded, serve and SGLang against transformers generate() ------------------------------

MODELS = {"tiny": None, "26m": {"n_embd": 512, "n_layer": 8, "n_head": 8}, "smollm2": "smollm2-135m-instruct"}


def build_model(root: Path, name: str) -> Path:
    """The tiny test GPT-2, or a larger GPT-2 of the same tokenizer (random weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollshard.generate.models import init_model

    if isinstance(MODELS[name], str):  # a real model, kept in rollshard's cache folder
        from rollshard.store.models.gguf import cache_dir

        return init_model(cache_dir() / "models" / MODELS[name], preset=MODELS[name])
    tiny = init_model(root / "tiny", preset="tiny-gpt2", seed=0)
    if MODELS[name] is None:
        return tiny
    cfg = AutoConfig.from_pretrained(tiny)
    for k, v in MODELS[name].items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    path = root / name
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    for f in tiny.iterdir():  # tokenizer, chat template, generation config
        if f.suffix != ".safetensors" and f.name != "config.json":
            (path / f.name).write_bytes(f.read_bytes())
    return path


def workload(name: str, batch: int, new_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) per request."""
    import random

    if name == "equal":
        return [([1, *range(10 + i, 10 + i + 31)], new_tokens) for i in range(batch)]
    rng = random.Random(0)
    return [
        ([rng.randrange(3, 1000) for _ in range(rng.randint(8, 64))], rng.randint(16, 256)) for _ in range(4 * batch)
    ]


def run_generate(model, requests, batch: int, pad_id: int, device: str = "cpu") -> tuple[float, int]:
    """transformers generate() in static batches of ``batch`` (arrival order), each to its longest request."""
    import torch
    from transformers import GenerationConfig

    # Sampling at T = 1 over the whole vocabulary (top_k 0: transformers' default is 50), eos off.
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id, eos_token_id=None)
    tokens, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch):
            chunk = requests[i : i + batch]
            length = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad_id] * (length - len(p)) + p for p, _ in chunk], device=device)
            mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
            longest = max(n for _, n in chunk)
            config = GenerationConfig(**sampling, max_new_tokens=longest)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            assert out.shape[1] == length + longest
            tokens += sum(n for _, n in chunk)  # each request's own tokens; the rest of its row is padding work
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, tokens


async def run_embedded(engine, requests) -> tuple[float, int]:
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(engine.generate(p, SamplingParams(max_new_tokens=n), ignore_eos=True) for p, n in requests)
    )
    return time.perf_counter() - t0, sum(len(r.output_ids) for r in results)


async def run_http(url: str, requests) -> tuple[float, int]:
    """Native /generate with logprobs and ignore_eos, every request in flight (the server batches)."""
    import aiohttp

    # No client timeout: a big model on a busy machine takes minutes for the mixed workload.
    no_timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=no_timeout) as s:

        async def one(prompt, n) -> int:
            body = {
                "input_ids": prompt,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True},
                "return_logprob": True,
            }
            async with s.post(url + "/generate", json=body) as r:
                out = await r.json()
            assert r.status == 200, out
            assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"]) == n
            return n

        await one([1, 2, 3], 4)  # connection and server warm
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p, n) for p, n in requests)))
        return time.perf_counter() - t0, tokens


def start_serve(model: Path, batch: int) -> tuple[subprocess.Popen, str]:
    import re

    proc = subprocess.Popen(
        [sys.executable, "-m", "rollshard.generate", "serve", "--model", str(model), "--port", "0",
         "--max-batch-size", str(batch)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    for line in proc.stdout:
        m = re.search(r"ready on (http://[\d.]+:\d+)", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError(f"rollshard-generate serve did not start (exit {proc.wait()})")


def start_sglang(model: Path, batch: int, log: Path) -> tuple[subprocess.Popen, str]:
    import os
    import socket
    import urllib.request

    script = ["bash", str(REPO / "scripts" / "make_sglang_env.sh"), "--path"]
    venv = Path(subprocess.run(script, capture_output=True, text=True, check=True).stdout.strip())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    cmd = [
        str(venv / "bin" / "python"), "-m", "sglang.launch_server", "--model-path", str(model), "--dtype", "float32",
        "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
        "--skip-server-warmup", "--max-total-tokens", "65536", "--max-running-requests", str(batch),
        "--mem-fraction-static", "0.05", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"SGLang server did not start; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """End a server and its process group (SGLang's scheduler and detokenizer)."""
    import os
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def paused(procs: list[subprocess.Popen]):
    """The other servers stopped (SIGSTOP) while one engine runs: SGLang's CPU scheduler polls a core even when
    idle, and on two cores that halves everyone else's."""
    import os
    import signal

    for p in procs:
        os.killpg(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGCONT)


def bench_models(args) -> dict:
    import statistics

    from rollshard.generate.engines.embedded import EmbeddedEngine, load_causal_lm

    root = Path(tempfile.mkdtemp(prefix="rollshard-bench-engines-"))
    figures: dict = {}
    for name in args.models:
        model_path = build_model(root, name)
        model = load_causal_lm(model_path)
        servers = {"serve": start_serve(model_path, args.batch)}
        if args.sglang:
            servers["sglang"] = start_sglang(model_path, args.batch, root / f"sglang-{name}.log")
        try:
            threads = {} if args.threads is None else {"threads": args.threads}  # else the engine's default
            engine = EmbeddedEngine(model_path, max_batch_size=args.batch, **threads)

            async def warm() -> None:
                await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4), ignore_eos=True)

            asyncio.run(warm())
            pad = engine.tokenizer.pad_token_id or 0
            for wl in args.workloads:
                requests = workload(wl, args.batch, args.new_tokens)
                rates: dict[str, list[float]] = {}
                for _ in range(args.repeat):  # in turn: a busy machine slows every engine of a round alike
                    runs = {"generate": lambda: run_generate(model, requests, args.batch, pad)}
                    runs["embedded"] = lambda: asyncio.run(run_embedded(engine, requests))
                    for key, (_, url) in servers.items():
                        runs[key] = lambda url=url: asyncio.run(run_http(url, requests))
                    for key, fn in runs.items():
                        with paused([proc for k, (proc, _) in servers.items() if k != key]):
                            seconds, tokens = fn()
                        rates.setdefault(key, []).append(tokens / seconds)
                row = {"requests": len(requests), "tokens": sum(n for _, n in requests)}
                for key, values in rates.items():
                    row[f"{key}_tok_s"] = round(statistics.median(values))
                    if key != "generate":
                        ratios = sorted(v / g for v, g in zip(values, rates["generate"]))
                        row[f"{key}_vs_generate"] = round(statistics.median(ratios), 3)
                        row[f"{key}_vs_generate_range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
                if "sglang" in rates:
                    ratios = sorted(v / g for v, g in zip(rates["serve"], rates["sglang"]))
                    row["serve_vs_sglang"] = round(statistics.median(ratios), 3)
                figures[f"{name}/{wl}"] = row
                print(json.dumps({f"{name}/{wl}": row}), file=sys.stderr, flush=True)  # progress, kept if a later one fails
            asyncio.run(engine.close())
        finally:
            for proc, _ in servers.values():
                stop(proc)
    return figures


def engines_table(figures: dict) -> list[str]:
    keys = ["generate", "embedded", "serve", "sglang"]
    present = [k for k in keys if any(f"{k}_tok_s" in row for row in figures.values())]
    rows = [
        "| model / workload | " + " | ".join(f"{k} tok/s" for k in present) + " | embedded / generate | serve / generate |"
        + (" serve / sglang |" if "sglang" in present else ""),
        "|---" * (len(present) + 3 + ("sglang" in present)) + "|",
    ]
    for name, row in figures.items():
        cells = [f"{row[f'{k}_tok_s']:,}" for k in present]
        ratios = [f"{row['embedded_vs_generate']:.2f}x {row['embedded_vs_generate_range']}",
                  f"{row['serve_vs_generate']:.2f}x {row['serve_vs_generate_range']}"]  # fmt: skip
        if "sglang" in present:
            ratios.append(f"{row['serve_vs_sglang']:.2f}x")
        rows.append(f"| {name} | " + " | ".join(cells + ratios) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["client", "engines"], default=None, help="run one part (default: both)")
    ap.add_argument("--requests-per-slot", type=int, default=8, help="requests per concurrency slot (client bench)")
    ap.add_argument("--client-repeat", type=int, default=3, help="rounds of the client bench per case")
    ap.add_argument("--tokens", type=int, default=256, help="response tokens per canned response (client bench)")
    ap.add_argument("--models", default="tiny,26m", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--workloads", default="equal,mixed", help="comma-separated, of equal, mixed")
    ap.add_argument("--batch", type=int, default=32, help="static batch of generate(), rows of the engines")
    ap.add_argument("--new-tokens", type=int, default=128, help="max_new_tokens of the equal workload")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the engines bench")
    ap.add_argument("--sglang", action="store_true", help="also the real SGLang CPU server (engines bench)")
    ap.add_argument(
        "--threads", type=int, default=None,
        help="torch threads of every engine, servers included (OMP_NUM_THREADS); default torch's own. On a shared "
        "machine 1 keeps a descheduled thread from stalling every parallel kernel",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--serve-canned", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_canned is not None:
        serve_canned(args.serve_canned, args.tokens)
        return
    args.models = [m for m in args.models.split(",") if m]
    args.workloads = [w for w in args.workloads.split(",") if w]
    bad = [m for m in args.models if m not in MODELS] + [w for w in args.workloads if w not in ("equal", "mixed")]
    if bad or args.repeat < 1 or args.batch < 1 or (args.threads is not None and args.threads < 1):
        ap.error(f"unknown model or workload {bad}" if bad else "--repeat, --batch and --threads must be >= 1")
    if args.threads is not None:
        import os

        import torch

        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the servers
    figures: dict = {}
    if args.only in (None, "client"):
        figures["client"] = bench_client(args)
    if args.only in (None, "engines"):
        figures["engines"] = bench_models(args)
    if args.json:
        print(json.dumps(figures))
        return
    if "client" in figures:
        loop = figures["client"][0]["server_loop"]
        print(f"SGLang client vs a {args.tokens}-token canned server ({loop} loop), median of {args.client_repeat}\n")
        print("\n".join(client_table(figures["client"])))
    if "engines" in figures:
        print(f"\nEngines vs transformers generate(), batch {args.batch}, response tokens/s (median of {args.repeat})\n")
        print("\n".join(engines_table(figures["engines"])))


if __name__ == "__main__":
    main()

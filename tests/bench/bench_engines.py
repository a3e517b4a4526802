"""Engine benchmark: SGLang client overhead against a fixed-latency server, embedded engine throughput.

    .venv/bin/python tests/bench/bench_engines.py [--requests-per-slot 20] [--tokens 256] [--new-tokens 128]

(a) The SGLang client against a stand-in server (a subprocess, so its CPU is not
    counted) that answers every ``/generate`` after a fixed latency L with a canned
    response of ``--tokens`` tokens and logprobs. With C requests in flight the
    ceiling is C / L requests per second; the client should reach >= 95% of it. Client
    CPU time is reported per 1,000 response tokens (JSON decode + strict validation).
(b) The embedded engine on the tiny GPT-2 preset: response tokens per second at
    batch 1 (one request at a time) and batch 32 (32 concurrent requests), eos off so
    every request runs to ``--new-tokens``.
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aiohttp import web

from rollshard.generate.engines import SamplingParams
from rollshard.generate.engines.sglang import SGLangConfig, SGLangEngine


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
    await eng.generate(prompt, sp)  # warm the connection pool
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


def bench_client(args) -> list[str]:
    rows = [
        "| in flight C | latency L | ceiling C/L req/s | achieved req/s | ratio | client CPU ms / 1k tokens |",
        "|---|---|---|---|---|---|",
    ]
    # From a stress case (short latency, many requests per second) to SGLang-like latencies with many in flight.
    for concurrency, latency in [(32, 0.1), (256, 1.0), (512, 2.0)]:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-canned", str(latency), "--tokens", str(args.tokens)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            port = int(proc.stdout.readline())
            n = concurrency * args.requests_per_slot
            wall, cpu, tokens = asyncio.run(client_run(f"http://127.0.0.1:{port}", concurrency, n))
        finally:
            proc.terminate()
            proc.wait()
        ceiling = concurrency / latency
        achieved = n / wall
        rows.append(
            f"| {concurrency} | {latency * 1000:.0f} ms | {ceiling:.0f} | {achieved:.0f} | {achieved / ceiling:.3f} | {1000 * cpu / tokens * 1000:.2f} |"
        )
    return rows


def bench_embedded(args) -> list[str]:
    from rollshard.generate.engines.embedded import EmbeddedEngine
    from rollshard.generate.models import init_model

    model = init_model(Path(tempfile.mkdtemp(prefix="rollshard-bench-")) / "tiny", preset="tiny-gpt2")
    rows = ["| engine | batch | response tokens/s |", "|---|---|---|"]

    async def go(batch: int) -> float:
        async with EmbeddedEngine(model, max_batch_size=32) as eng:
            eng.eos_ids = []  # every request runs to max_new_tokens
            sp = SamplingParams(max_new_tokens=args.new_tokens)
            prompts = [[1, *range(10 + i, 10 + i + 31)] for i in range(batch)]
            await eng.generate(prompts[0], SamplingParams(max_new_tokens=4))  # warm up
            t0 = time.perf_counter()
            if batch == 1:
                results = [await eng.generate(prompts[0], sp) for _ in range(4)]
            else:
                results = await asyncio.gather(*(eng.generate(p, sp) for p in prompts))
            return sum(len(r.output_ids) for r in results) / (time.perf_counter() - t0)

    for batch in (1, 32):
        rows.append(f"| embedded tiny-gpt2 (CPU) | {batch} | {asyncio.run(go(batch)):.0f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests-per-slot", type=int, default=8, help="requests per concurrency slot (client bench)")
    ap.add_argument("--tokens", type=int, default=256, help="response tokens per canned response")
    ap.add_argument("--new-tokens", type=int, default=128, help="max_new_tokens in the embedded bench")
    ap.add_argument("--serve-canned", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_canned is not None:
        serve_canned(args.serve_canned, args.tokens)
        return
    print(f"SGLang client vs a {args.tokens}-token canned server\n")
    print("\n".join(bench_client(args)))
    print(f"\nEmbedded engine, {args.new_tokens} new tokens per request, 32-token prompts\n")
    print("\n".join(bench_embedded(args)))


if __name__ == "__main__":
    main()

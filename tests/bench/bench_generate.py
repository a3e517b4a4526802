"""Benchmark: what the batch runner, agent system and writer cost on top of the engine client.

A fixed-latency fake SGLang server (aiohttp, its own process, 127.0.0.1) answers every
``/generate`` after ``--latency`` seconds with ``--tokens`` canned token ids and
logprobs. Two clients drive it with ``--concurrency`` requests in flight:

* bare: :class:`rollshard.generate.engines.sglang.SGLangEngine` alone, the same number
  of requests with the same prompt ids, results dropped;
* runner: the ``rollshard-generate`` runner (agent system, verifier, row building,
  validation, Parquet writer with commits) over prompts that make the same number of
  requests, into a fresh dataset.

The figure of merit is runner rows/s (and response tokens/s) over bare requests/s;
target >= 0.95. ``single`` is the headline (one round per prompt); ``multi_agent`` has
three dependent rounds per prompt, so its ratio also holds the tail where the last
episodes' later rounds cannot fill every slot.

Latency: 0.5 s by default, short for an LLM request. Much lower (0.2 s at concurrency
64 is 320 requests/s) makes both clients CPU-bound on a 2-core machine that also runs
the server, and the ratio then compares CPU per request rather than overhead on a
real engine.

    .venv/bin/python tests/bench/bench_generate.py [--agents single|multi_agent] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def serve(port: int, latency: float, tokens: int, model: str) -> None:
    """The fake server: canned ids (3..) and logprobs, the same for every request."""
    from aiohttp import web

    rng = random.Random(0)
    ids = [rng.randrange(3, 1000) for _ in range(tokens)]
    body = json.dumps(
        {
            "text": "so the answer is \\boxed{42}. Judgment: 1",
            "output_ids": ids,
            "meta_info": {
                "id": "x",
                "finish_reason": {"type": "length", "length": tokens},
                "prompt_tokens": 0,
                "completion_tokens": tokens,
                "weight_version": "0",
                "output_token_logprobs": [[-round(rng.uniform(0.01, 5), 4), t, None] for t in ids],
            },
        }
    )

    async def generate(request):
        await request.read()
        await asyncio.sleep(latency)
        return web.Response(text=body, content_type="application/json")

    async def info(request):
        return web.json_response({"model_path": model, "tokenizer_path": model, "weight_version": "0"})

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.get("/get_model_info", info), web.get("/health", health)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, timeout: float = 30.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"fake server at {url} did not come up")


async def bare(url: str, prompt_ids: list[list[int]], n_requests: int, concurrency: int, max_new: int) -> tuple[float, int]:
    from rollshard.generate.engines.base import SamplingParams
    from rollshard.generate.engines.sglang import SGLangConfig, SGLangEngine

    engine = SGLangEngine([url], config=SGLangConfig(max_concurrency=concurrency))
    slots = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with slots:
            r = await engine.generate(prompt_ids[i % len(prompt_ids)], SamplingParams(max_new_tokens=max_new, sampling_seed=i))
        tokens += len(r.output_ids)

    await engine.model_info()  # warm the connection pool as the runner's health check does
    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n_requests)))
    seconds = time.perf_counter() - start
    await engine.close()
    return seconds, tokens


async def runner(url: str, model: Path, prompts, out: Path, args):
    from rollshard.generate.agents import make_agent_system
    from rollshard.generate.engines.base import SamplingParams
    from rollshard.generate.engines.sglang import SGLangConfig, SGLangEngine
    from rollshard.generate.runner import Runner, RunnerOptions
    from rollshard.generate.tasks import get_task
    from rollshard.store.models.tokenizer import load_tokenizer
    from rollshard.store.io.writer import ShardWriter

    engine = SGLangEngine([url], config=SGLangConfig(max_concurrency=args.concurrency))
    await engine.model_info()
    system = make_agent_system(args.agents, n_samples=args.n_samples)
    with ShardWriter(out, writer_id="gen-0-of-1", config={"bench": True}) as writer:
        r = Runner(
            system=system,
            task=get_task("math"),
            engine=engine,
            tokenizer=load_tokenizer(model),
            sampling=SamplingParams(max_new_tokens=args.tokens),
            writer=writer,
            options=RunnerOptions(concurrency=args.concurrency, request_timeout=None, progress=False),  # as run.py for URLs
        )
        result = await r.run(prompts)
    await engine.close()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", default="single", choices=["single", "multi_agent"])
    p.add_argument("--prompts", type=int, default=320)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--latency", type=float, default=0.5, help="server seconds per request")
    p.add_argument("--tokens", type=int, default=128, help="response tokens per request")
    p.add_argument("--json", action="store_true")
    p.add_argument("--serve", nargs=4, metavar=("PORT", "LATENCY", "TOKENS", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(int(args.serve[0]), float(args.serve[1]), int(args.serve[2]), args.serve[3])
        return 0

    from rollshard.generate.models import init_model
    from rollshard.generate.tasks import Prompt, get_task
    from rollshard.store.models.tokenizer import apply_chat_template, load_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    model = init_model(tmp / "tiny", preset="tiny-gpt2")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), str(args.latency), str(args.tokens), str(model)],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_up(url)
        task = get_task("math")
        prompts = [
            Prompt(prompt_id=f"q{i:05d}", index=i, content=f"What is {i} + {2 * i}?", label=str(3 * i))
            for i in range(args.prompts)
        ]
        tok = load_tokenizer(model)
        ids = [apply_chat_template(tok, task.messages(q)) for q in prompts[:64]]

        result = asyncio.run(runner(url, model, prompts, tmp / "ds", args))
        n_requests = result.rows  # every row of these systems is one request
        bare_s, bare_tokens = asyncio.run(bare(url, ids, n_requests, args.concurrency, args.tokens))
    finally:
        server.terminate()
        server.wait()

    ideal = -(-n_requests // args.concurrency) * args.latency
    figures = {
        "agents": args.agents,
        "requests": n_requests,
        "concurrency": args.concurrency,
        "latency_s": args.latency,
        "ideal_s": ideal,
        "bare_s": round(bare_s, 3),
        "bare_requests_per_s": round(n_requests / bare_s, 1),
        "bare_tokens_per_s": round(bare_tokens / bare_s, 0),
        "runner_s": round(result.seconds, 3),
        "runner_rows_per_s": round(result.rows / result.seconds, 1),
        "runner_tokens_per_s": round(result.response_tokens / result.seconds, 0),
        "ratio_rows": round((result.rows / result.seconds) / (n_requests / bare_s), 3),
        "ratio_tokens": round((result.response_tokens / result.seconds) / (bare_tokens / bare_s), 3),
        "failed": len(result.failed),
    }
    if args.json:
        print(json.dumps(figures))
    else:
        print(
            f"{args.agents}: {n_requests} requests, concurrency {args.concurrency}, latency {args.latency * 1000:.0f} ms "
            f"(ideal {ideal:.2f} s)\n"
            f"  bare client: {figures['bare_s']:.2f} s, {figures['bare_requests_per_s']} req/s, "
            f"{figures['bare_tokens_per_s']:.0f} tokens/s\n"
            f"  runner:      {figures['runner_s']:.2f} s, {figures['runner_rows_per_s']} rows/s, "
            f"{figures['runner_tokens_per_s']:.0f} tokens/s\n"
            f"  ratio: rows {figures['ratio_rows']}, tokens {figures['ratio_tokens']} (target >= 0.95)"
        )
    return 0 if not result.failed else 1


if __name__ == "__main__":
    sys.exit(main())

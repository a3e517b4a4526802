"""``rollshard-generate serve``: the embedded engine behind SGLang's native HTTP API.

Endpoints mirror SGLang's request and response shapes, so the SGLang client
(:mod:`rollshard.generate.engines.sglang`) drives this server exactly as it drives a
real one:

* ``POST /generate`` — ``input_ids`` (or ``text``), ``sampling_params``,
  ``return_logprob``, ``rid`` -> ``{"text", "output_ids", "meta_info"}``;
* ``GET /health``, ``GET /get_model_info``;
* ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"}`` ->
  ``{"success", "message", "num_paused_requests"}``;
* ``POST /update_weight_version`` ``{"new_version"}``; ``/flush_cache``.

Not supported (400): streaming, batched ``input_ids`` (a list of lists), and
sampling parameters other than the ones in :class:`SamplingParams` unless they hold
their neutral value (``min_p: 0``, penalties 0/1, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import time
from typing import Any

from aiohttp import web

from rollshard.generate.engines.base import EngineError, SamplingParams
from rollshard.generate.engines.embedded import EmbeddedEngine
from rollshard.store.tokenizer import encode

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# SGLang sampling parameters this engine does not implement, with the value that makes them a no-op.
NEUTRAL_SAMPLING = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "ignore_eos": False,
    "spaces_between_special_tokens": True,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
    "custom_params": None,
}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"request body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="request body must be a JSON object")
    return body


def sampling_from_json(raw: dict[str, Any] | None) -> SamplingParams:
    raw = dict(raw or {})
    unsupported = [
        k
        for k, v in raw.items()
        if k not in SAMPLING_FIELDS and (k not in NEUTRAL_SAMPLING or v != NEUTRAL_SAMPLING[k])
    ]
    if unsupported:
        raise ValueError(f"sampling parameter(s) {sorted(unsupported)} not supported by the embedded engine")
    return SamplingParams(**{k: v for k, v in raw.items() if k in SAMPLING_FIELDS})


class Server:
    """aiohttp application around one :class:`EmbeddedEngine`."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.app = web.Application(client_max_size=64 * 1024**2)
        self.app.add_routes(
            [
                web.post("/generate", self.generate),
                web.get("/health", self.health),
                web.get("/health_generate", self.health),
                web.get("/get_model_info", self.model_info),
                web.post("/update_weights_from_disk", self.update_weights_from_disk),
                web.post("/update_weight_version", self.update_weight_version),
                web.post("/flush_cache", self.flush_cache),
                web.get("/flush_cache", self.flush_cache),
            ]
        )

    async def generate(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("stream"):
            return _error(400, "streaming is not supported by rollshard-generate serve")
        input_ids = body.get("input_ids")
        if input_ids is None and isinstance(body.get("text"), str):
            input_ids = encode(self.engine.tokenizer, body["text"])
        if not isinstance(input_ids, list) or not all(isinstance(t, int) for t in input_ids):
            return _error(
                400, "input_ids must be one list of token ids (or give text); batched requests are not supported"
            )
        try:
            sampling = sampling_from_json(body.get("sampling_params"))
        except (TypeError, ValueError) as e:
            return _error(400, f"bad sampling_params: {e}")
        start = time.perf_counter()
        try:
            result = await self.engine.generate(input_ids, sampling, rid=body.get("rid"))
        except EngineError as e:
            return _error(400, str(e))
        meta: dict[str, Any] = {
            "id": result.meta.get("id"),
            "finish_reason": {"type": result.finish_reason, **result.finish_detail},
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "cached_tokens": result.meta.get("cached_tokens", 0),
            "weight_version": result.weight_version,
            "weight_versions": [dataclasses.asdict(w) for w in result.weight_versions or []],
            "e2e_latency": time.perf_counter() - start,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(result.logprobs, result.output_ids)]
            meta["input_token_logprobs"] = []
        return web.json_response({"text": result.text, "output_ids": result.output_ids, "meta_info": meta})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(await self.engine.model_info())

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        path = body.get("model_path")
        if not path:
            return web.json_response(
                {"success": False, "message": "model_path is required", "num_paused_requests": 0}, status=400
            )
        version = body.get("weight_version")
        try:
            new = await self.engine.load_weights(path, None if version is None else str(version))
        except EngineError as e:
            return web.json_response({"success": False, "message": str(e), "num_paused_requests": 0}, status=400)
        return web.json_response(
            {
                "success": True,
                "message": f"Succeeded to update model weights (weight_version {new}).",
                "num_paused_requests": 0,
            }
        )

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("new_version") is None:
            return web.json_response({"success": False, "message": "new_version is required"}, status=400)
        await self.engine.update_weight_version(str(body["new_version"]))
        return web.json_response(
            {"success": True, "message": "Weight version updated.", "new_version": self.engine.weight_version}
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self.engine.flush_cache()
        return web.Response(text="Cache flushed.\n")


async def serve(args: argparse.Namespace) -> None:
    engine = EmbeddedEngine(
        args.model,
        device=args.device,
        seed=args.seed,
        max_batch_size=args.max_batch_size,
        weight_version=args.weight_version,
    )
    server = Server(engine)
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"rollshard-generate serve: ready on http://{host}:{port} (model {args.model})", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rollshard-generate serve",
        description="Serve a local model with the embedded engine behind SGLang's native HTTP API.",
    )
    parser.add_argument(
        "--model", required=True, help="local HF model folder (e.g. from `rollshard-generate init-model`)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port (default 30000, SGLang's; 0 picks a free one)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed for requests without sampling_seed")
    parser.add_argument("--max-batch-size", type=int, default=32, help="rows decoded together (default 32)")
    parser.add_argument("--weight-version", default="0", help="initial weight_version reported (default 0)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args))
    except EngineError as e:
        parser.exit(2, f"rollshard-generate serve: error: {e}\n")
    return 0

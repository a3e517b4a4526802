"""``rollshard-generate serve``: the embedded engine behind SGLang's native HTTP API.

Endpoints mirror SGLang's request and response shapes, so the SGLang client
(:mod:`rollshard.generate.engines.sglang`) drives this server exactly as it drives a
real one:

* ``POST /generate`` — ``input_ids`` (or ``text``), ``sampling_params``,
  ``return_logprob``, ``rid`` -> ``{"text", "output_ids", "meta_info"}``;
* ``POST /abort_request`` ``{"rid", "abort_all"}`` -> 200 with an empty body, as SGLang
  (also for a rid not in flight); the aborted ``/generate`` answers 200 with finish
  reason ``abort`` and the tokens generated so far with their logprobs;
* ``GET /health``, ``GET /get_model_info``, ``GET /get_server_info`` (the SGLang settings a client checks:
  ``sampling_mask_max_tokens``); both info answers add ``busy_seconds`` and ``uptime_seconds`` (floats: the
  engine's time on a non-empty batch, and since it loaded the model), whose ratio a loop reports as the
  engine's busy share;
* ``return_sampling_mask: true`` (top level) adds ``meta_info.output_token_sampling_mask`` (per output
  token, the ids it was sampled from) and ``output_token_sampling_logprobs`` (its logprob under that
  renormalized support), refused as SGLang refuses it without a finite top_k (see
  :mod:`rollshard.generate.serve_requests`);
* ``return_routed_experts: true`` (top level), on a server started with ``--enable-return-routed-experts``
  (a MoE model), adds ``meta_info.routed_experts`` as SGLang 0.5.23 sends it: base64 of the little-endian
  int32 ids ``[input + output - 1, layers, top_k]``; without the flag the key is absent, as there;
* ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"}`` ->
  ``{"success", "message", "num_paused_requests"}``;
* ``POST /update_weight_version`` ``{"new_version"}``; ``/flush_cache``.

Every body is validated by :mod:`rollshard.generate.serve_requests` (400 naming the
field). ``sampling_params.ignore_eos`` is SGLang's: no token ends the request (neither
an eos nor ``stop_token_ids``), stop strings and ``max_new_tokens`` still do. Not
supported (400): streaming, batched ``input_ids`` (a list of lists), and sampling
parameters other than the ones in :class:`SamplingParams` unless they hold their
neutral value (``min_p: 0``, penalties 0/1, ...).

The event loop only routes: bodies are capped relative to the context
(:func:`body_limit`, 413 beyond), a ``text`` that cannot fit the context is refused
before it is tokenized, large bodies are parsed and texts tokenized on threads, so one
huge request cannot stall ``/health`` or the other requests.
"""

from __future__ import annotations

import argparse
import base64
import asyncio
import dataclasses
import json
import signal
import time
from typing import Any

from aiohttp import web

from rollshard.generate.engines.base import EngineError
from rollshard.generate.engines.embedded import DEFAULT_MAX_BATCH_SIZE, EmbeddedEngine
from rollshard.generate.serve_requests import SAMPLING_MASK_MAX_TOKENS, RequestError, parse_abort, parse_generate
from rollshard.store.models.tokenizer import TokenizerError, encode

# A JSON string escapes a byte into at most 6 characters (\u00XX); the rest of a body (sampling
# parameters, stop strings) gets this much room on top.
JSON_ESCAPE_FACTOR = 6
BODY_OVERHEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024**2  # whatever the context: a bound on what one request may make the server hold
PARSE_ON_LOOP_MAX_BYTES = 64 * 1024  # larger bodies are parsed on a thread


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for: its longest vocabulary entry's.

    Vocabulary entries spell their text with at least as many bytes as it has (byte-level BPE maps
    each byte to one character; SentencePiece writes a space as the 3-byte U+2581)."""
    return max(len(piece.encode("utf-8")) for piece in tokenizer.get_vocab())


def body_limit(context: int, token_bytes: int, vocab_size: int) -> int:
    """Largest request body accepted: a text of ``context`` tokens, JSON-escaped, or as many ids; never more
    than :data:`MAX_BODY_BYTES` (a model without a context length reports 2**30)."""
    ids = context * (len(str(vocab_size)) + 2)  # "12345, " per id
    return min(max(context * token_bytes * JSON_ESCAPE_FACTOR, ids) + BODY_OVERHEAD_BYTES, MAX_BODY_BYTES)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise web.HTTPRequestEntityTooLarge(
            max_size=request.client_max_size,
            actual_size=request.content_length or 0,
            text=json.dumps(
                {
                    "error": {
                        "message": f"request body exceeds the limit of {request.client_max_size} bytes "
                        "(a text or input_ids filling the model's context fits); send a shorter prompt"
                    }
                }
            ),
            content_type="application/json",
        ) from e
    try:
        body = json.loads(raw) if len(raw) <= PARSE_ON_LOOP_MAX_BYTES else await asyncio.to_thread(json.loads, raw)
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"request body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="request body must be a JSON object")
    return body


class Server:
    """aiohttp application around one :class:`EmbeddedEngine`."""

    def __init__(self, engine: EmbeddedEngine, *, routed_experts: bool = False) -> None:
        self.engine = engine
        self.routed_experts = routed_experts  # --enable-return-routed-experts
        token_bytes = longest_token_bytes(engine.tokenizer)
        self.text_byte_limit = engine.context * token_bytes  # more bytes than this is more tokens than the context
        limit = body_limit(engine.context, token_bytes, engine.model.config.vocab_size)
        self.app = web.Application(client_max_size=limit)
        self.app.add_routes(
            [
                web.post("/generate", self.generate),
                web.post("/abort_request", self.abort_request),
                web.get("/health", self.health),
                web.get("/health_generate", self.health),
                web.get("/get_model_info", self.model_info),
                web.get("/get_server_info", self.server_info),
                web.post("/update_weights_from_disk", self.update_weights_from_disk),
                web.post("/update_weight_version", self.update_weight_version),
                web.post("/flush_cache", self.flush_cache),
                web.get("/flush_cache", self.flush_cache),
            ]
        )

    async def generate(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            req = parse_generate(body, context=self.engine.context, text_byte_limit=self.text_byte_limit)
        except RequestError as e:
            return _error(400, str(e))
        input_ids = req.input_ids
        if input_ids is None:
            input_ids = await asyncio.to_thread(encode, self.engine.tokenizer, req.text)
        start = time.perf_counter()
        # SGLang answers return_routed_experts only when started with --enable-return-routed-experts (silently
        # nothing otherwise), and only for a MoE model (a dense one does not start with the flag).
        routed = req.return_routed_experts and self.routed_experts
        sampling = dataclasses.replace(req.sampling, return_routed_experts=True) if routed else req.sampling
        try:
            result = await self.engine.generate(input_ids, sampling, rid=req.rid)
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
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(result.logprobs, result.output_ids)]
            meta["input_token_logprobs"] = []
        if req.return_sampling_mask:  # SGLang's names and shapes: one id list and one float per output token
            meta["output_token_sampling_mask"] = result.sampling_support or []
            meta["output_token_sampling_logprobs"] = result.sampling_logprobs or []
            meta["output_token_sampling_mask_length"] = len(result.sampling_support or [])
        if routed and result.routed_experts is not None:  # SGLang 0.5.23's wire format: base64 of int32 ids
            meta["routed_experts"] = base64.b64encode(result.routed_experts.astype("<i4").tobytes()).decode()
        return web.json_response({"text": result.text, "output_ids": result.output_ids, "meta_info": meta})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            rid, abort_all = parse_abort(await _json_body(request))
        except RequestError as e:
            return _error(400, str(e))
        if abort_all:
            self.engine.abort_all()
        else:
            self.engine.abort(rid)
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({**await self.engine.model_info(), **self.engine.utilization()})

    async def server_info(self, request: web.Request) -> web.Response:
        info = await self.engine.model_info()
        return web.json_response(
            {**info, **self.engine.utilization(), "sampling_mask_max_tokens": SAMPLING_MASK_MAX_TOKENS}
        )

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        path, version = body.get("model_path"), body.get("weight_version")
        problem = None
        if not (isinstance(path, str) and path):
            problem = "model_path (a string) is required"
        elif version is not None and not isinstance(version, str):
            problem = f"weight_version must be a string, got {version!r}"
        if problem:
            return web.json_response({"success": False, "message": problem, "num_paused_requests": 0}, status=400)
        try:
            new = await self.engine.load_weights(path, version)
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
        if not isinstance(body.get("new_version"), str):
            return web.json_response({"success": False, "message": "new_version (a string) is required"}, status=400)
        await self.engine.update_weight_version(body["new_version"])
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
        dtype=args.dtype,
        seed=args.seed,
        max_batch_size=args.max_batch_size,
        weight_version=args.weight_version,
        threads=args.threads,
    )
    if args.enable_return_routed_experts and engine.routing_shape is None:
        await engine.close()
        why = engine.routing_reason or "it is not a mixture of experts"
        raise EngineError(f"--enable-return-routed-experts: model {args.model}: {why}")
    server = Server(engine, routed_experts=args.enable_return_routed_experts)
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
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="weights and compute dtype (default float32: logprobs within ~1e-6 of the fp32 trainer's)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed for requests without sampling_seed")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                        help="rows decoded together (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch threads of the decode (default: the machine's cores less one, at least 1)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="answer return_routed_experts requests with meta_info.routed_experts (SGLang's flag and "
                        "wire format: base64 of int32 [input + output - 1, layers, top_k]); a MoE model only")
    parser.add_argument(
        "--weight-version", default=None,
        help="weight_version reported (default: the checkpoint's own, from its trainer_state.json; else 0)",
    )
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args))
    except (EngineError, TokenizerError) as e:
        parser.exit(2, f"rollshard-generate serve: error: {e}\n")
    return 0

"""Scripted stand-ins for an SGLang server on 127.0.0.1, shared by the SGLang client tests."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

IDS = [11, 12, 13]
LPS = [-0.5, -1.25, -2.0]


def with_support(body, supports, sampling_lps):
    """``body`` with SGLang 0.5.23's return_sampling_mask fields (the shapes measured on a real server)."""
    body["meta_info"].update(
        output_token_sampling_mask=supports,
        output_token_sampling_logprobs=sampling_lps,
        output_token_sampling_mask_length=len(supports),
    )
    return body


def ok_body(ids=IDS, lps=LPS, *, finish=None, **meta):
    return {
        "text": "abc",
        "output_ids": list(ids),
        "meta_info": {
            "id": "x",
            "finish_reason": finish or {"type": "length", "length": len(ids)},
            "prompt_tokens": 4,
            "completion_tokens": len(ids),
            "weight_version": "3",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
            **meta,
        },
    }


class FakeSGLang:
    """A scripted SGLang.

    Each /generate pops the next action of ``script`` (then ``default``): 'ok', an HTTP status (int),
    'drop' (close the connection), 'hang' (answer only when the fake shuts down), 'broken' (half an
    answer once ``gate`` is set), or a body dict.
    /health pops ``health_script`` (then 200); /abort_request records the rid in ``aborts`` and answers
    ``abort_action`` (200, an int status, or 'hang'); /get_model_info answers ``info``; /get_server_info
    answers ``server_info`` (404 when None).
    """

    def __init__(
        self, script=(), *, default="ok", latency=0.0, health_script=(), abort_action=200, info=None, server_info=None
    ):
        self.script = list(script)
        self.default = default
        self.latency = latency
        self.health_script = list(health_script)
        self.abort_action = abort_action
        self.info = info if info is not None else {"model_path": "fake", "weight_version": "3"}
        self.server_info = server_info
        self.requests: list[dict] = []
        self.aborts: list[str] = []
        self.health_requests = 0
        self.info_requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.url = ""
        self.stopped = False
        self.release = asyncio.Event()  # set on shutdown: 'hang' handlers return then
        self.gate = asyncio.Event()  # set by a test: 'broken' handlers answer then

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        action = self.script.pop(0) if self.script else self.default
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.latency:
                await asyncio.sleep(self.latency)
            if action == "drop":
                request.transport.close()  # the client sees the connection die mid-request
                await asyncio.sleep(0.05)
                return web.Response()
            if action == "hang":
                await self.release.wait()
                return web.Response(status=503)
            if action == "broken":  # once the test opens the gate: half an answer, then the connection closes
                await self.gate.wait()
                resp = web.StreamResponse(headers={"Content-Length": "100", "Content-Type": "application/json"})
                await resp.prepare(request)
                await resp.write(b'{"text": ')
                request.transport.close()
                return resp
            if isinstance(action, int):
                return web.json_response({"error": {"message": f"scripted {action}"}}, status=action)
            return web.json_response(ok_body() if action == "ok" else action)
        finally:
            self.in_flight -= 1

    async def abort_request(self, request: web.Request) -> web.Response:
        self.aborts.append((await request.json())["rid"])
        if self.abort_action == "hang":
            await self.release.wait()
        return web.Response(status=self.abort_action if isinstance(self.abort_action, int) else 200)

    async def health(self, request):
        self.health_requests += 1
        status = self.health_script.pop(0) if self.health_script else 200
        return web.Response(status=status, text="" if status == 200 else f"scripted {status}")

    async def model_info(self, request):
        self.info_requests += 1
        if isinstance(self.info, (bytes, str)):
            return web.Response(body=self.info, content_type="application/json")
        return web.json_response(self.info)

    async def get_server_info(self, request):
        if self.server_info is None:
            return web.Response(status=404, text="Not Found")
        return web.json_response(self.server_info)

    async def __aenter__(self):
        app = web.Application()
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.post("/abort_request", self.abort_request),
                web.get("/health", self.health),
                web.get("/get_model_info", self.model_info),
                web.get("/get_server_info", self.get_server_info),
            ]
        )
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Go away: close the listening socket and every open connection (later connects are refused)."""
        self.release.set()
        if not self.stopped:
            self.stopped = True
            await self.runner.cleanup()

    async def __aexit__(self, *exc):
        await self.stop()


class SlammingDoor:
    """A TCP listener that accepts each connection and closes it at once, counting them: a server that is
    "there" for the kernel but never answers (the client sees the server disconnect)."""

    def __init__(self) -> None:
        self.connections = 0
        self.url = ""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

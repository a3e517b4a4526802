"""SGLang native-API client: ``POST /generate`` with ``input_ids`` and ``return_logprob``, strictly parsed.

One pooled aiohttp session per event loop, bounded concurrency, several server URLs
(each request goes to the one with the fewest requests in flight, a server's connection
failures in a row each counting as a fair share of requests) or one sglang-router URL.

Retries. Connection errors, timeouts, 5xx answers and aborts whose ``status_code`` is >= 500
(the server's own failure: out of memory, retraction, its timeouts; see
:mod:`.sglang_protocol`) are retried with exponential backoff and jitter
(:func:`rollshard.store.common.backoff_delay`), preferring another server; a 4xx is the
caller's fault and fails at once. Every other abort (a client's ``/abort_request``, a weight
update aborting all requests, a 4xx-type abort) is final: it comes back as an ``abort``
result. A retry gets a fresh server-side id, ``retry<N>-<rid>``: SGLang aborts every request
whose id *starts with* the aborted one, so a retry must not extend the id of the attempt it
replaces.

Abandoned attempts are aborted. When an attempt times out, or the task awaiting it is
cancelled (Ctrl-C, a caller's ``wait_for``), the client posts ``/abort_request`` with the
attempt's id to the server the attempt went to, in the background and within
``abort_timeout_s``, so the server stops generating for nobody; :meth:`close` waits for
those posts (as long again at most). A failed abort is logged at debug level and never
replaces the original error. A dropped connection is not aborted: the server sees the
same disconnect and SGLang aborts the request itself.

Circuit breaker. Connection failures (refused, reset, server disconnected, and TCP
connect timeouts: a host that is down answers nothing at all) are counted per server,
over all requests; any HTTP answer from a server (even a 5xx: it is alive) resets its
count. When every server has ``breaker_threshold`` failures in a row, the request that
failed, and every request after it or retrying, raises :class:`EngineUnavailableError`
at once, without sending or sleeping. Per server, not one count for all: with hundreds
of requests in flight, one dead server among live ones refuses a hundred connections in
a row before a live one answers, and must not stop the run. A whole-request timeout does
not count (a long generation is not a dead server). The breaker has no timer: it closes
again on evidence of life, an answer to a request that was in flight when it opened, or
a successful :meth:`SGLangEngine.health_check` (a run stops at the first
EngineUnavailableError; an interactive user restarts the server and calls
``health_check``).

Health. :meth:`SGLangEngine.health_check` asks every server for ``/health`` and
``/get_model_info``, retrying connection errors, timeouts and 5xx like ``/generate``
(a server that is still starting answers 503); a 4xx or a model info that is not a JSON
object fails at once. It refuses a server whose ``preferred_sampling_params`` differ
from what the client sends: SGLang fills every sampling parameter a request leaves out
from them, so the stored logprobs would describe another distribution than the trainer
assumes. The client sends :data:`~.base.NEUTRAL_SAMPLING` with every request for the
same reason.

Parsing. The response must carry one logprob per response token. A missing or short
``meta_info.output_token_logprobs`` on a response that did not abort, a logprob
that is not a finite float, or token ids in the logprobs that disagree with
``output_ids`` raise :class:`EngineError` naming the request: a response without
its logprobs is never returned (slime issue #1976 / PR #1995). An aborted response
(``finish_reason.type == "abort"``) keeps the tokens that have a logprob, and its
weight-version spans are clipped to them; when that drops tokens, its text becomes
the kept tokens' texts from the logprob items when the server sent them
(``return_text_in_logprobs``), else empty: the server's text covers tokens that are
not kept. ``meta["weight_versions_sent"]`` keeps the spans as the server sent them
(None when it sent none and the single span was made from ``weight_version``).

Sampling support. With ``SamplingParams.return_sampling_mask`` the request carries
``return_sampling_mask: true`` at its top level (SGLang refuses the key inside
``sampling_params``), and the answer must carry ``meta_info.output_token_sampling_mask``
(per output token, the list of ids it was sampled from, in descending probability) and
``output_token_sampling_logprobs`` (the sampled token's logprob under that renormalized
support; greedy: ``[token]`` and 0.0), as SGLang 0.5.23 sends them. Missing, short, a
token outside its support, or a sampling logprob that is not finite, above 0 or below the
full logprob (``SAMPLING_LOGPROB_TOL``, 1e-4, the store's bound) is refused like missing
logprobs; an abort keeps the prefix that has all four. SGLang answers 400 unless the
request is greedy or has ``1 <= top_k <= --sampling-mask-max-tokens`` (4096 by default):
:meth:`SGLangEngine.health_check` reads that cap from ``/get_server_info`` and refuses
such settings at start (:func:`sampling_mask_problem`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import uuid
from typing import Any, Awaitable, Callable, Sequence

import aiohttp

from rollshard.generate.engines.base import (
    Engine,
    EngineError,
    EngineSettingsError,
    EngineUnavailableError,
    GenerateResult,
    SamplingParams,
)
from rollshard.generate.engines.sglang_protocol import (
    TransientAbortError,
    decode_json,
    encode_json,
    parse_response,
    preferred_sampling_differences,
)
from rollshard.store.common import backoff_delay
from rollshard.store.format.schema import GREEDY_TEMPERATURE_EPS
from rollshard.store.models.versions import VersionError, folder_weight_version

__all__ = ["SGLangConfig", "SGLangEngine", "parse_response", "sampling_mask_problem"]

log = logging.getLogger(__name__)

# SGLang's default --sampling-mask-max-tokens: the largest top_k with which it returns a sampling support.
SGLANG_SAMPLING_MASK_MAX_TOKENS = 4096
# Connections beyond max_concurrency kept for /abort_request: when every generate connection hangs
# (the case aborts exist for), an abort must not queue behind them for a free one.
CONTROL_CONNECTIONS = 16
JSON_HEADERS = {"Content-Type": "application/json"}  # request bodies are encoded here (encode_json), not by aiohttp
# Transport failures that say the server is not there (as opposed to slow): what the breaker counts.
CONNECTION_FAILURES = (
    aiohttp.ClientConnectorError,  # refused, unreachable, DNS
    aiohttp.ConnectionTimeoutError,  # no TCP handshake within connect_timeout_s
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,  # reset by peer
    ConnectionError,
)


@dataclasses.dataclass(kw_only=True)
class SGLangConfig:
    """Client settings; the defaults suit one GPU server and a runner keeping a few hundred requests in flight."""

    max_concurrency: int = 256  # requests in flight over all URLs
    request_timeout_s: float = 600.0  # whole request, connect to last byte
    connect_timeout_s: float = 10.0  # TCP handshake
    max_retries: int = 4  # attempts after the first, on connection errors, timeouts and 5xx; health_check too
    backoff_base_s: float = 0.5  # first retry waits about this long, then doubles
    backoff_max_s: float = 30.0
    health_timeout_s: float = 5.0  # one /health or /get_model_info attempt
    abort_timeout_s: float = 2.0  # one /abort_request for an abandoned attempt; close() waits as long for them
    breaker_threshold: int = 8  # connection failures in a row on every server stop the engine; 0: never
    logprob_start_len: int = -1  # SGLang: -1 computes no input-token logprobs


class _HTTPStatus(EngineError):
    """A 4xx answer; ``status`` tells a 404 (an endpoint a router does not forward) from the rest."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _Retryable(Exception):
    """A transient failure of one attempt (connection, timeout, 5xx)."""

    def __init__(self, message: str, *, connection: bool = False, may_run_on: bool = False) -> None:
        super().__init__(message)
        self.connection = connection  # the server did not answer at all: counts for the breaker
        self.may_run_on = may_run_on  # the server may still be generating for it: abort it there


class _Breaker:
    """Consecutive connection failures per server, over all requests (see the module docstring)."""

    def __init__(self, urls: Sequence[str], threshold: int) -> None:
        self.threshold = threshold
        self.failures = dict.fromkeys(urls, 0)
        self.down = 0  # servers with at least `threshold` failures in a row
        self.last = ""
        self.open = False

    def alive(self, url: str) -> None:
        if self.failures.get(url):  # a router's worker, sent a control request directly, is not counted
            if self.threshold and self.failures[url] >= self.threshold:
                self.down -= 1
            self.failures[url] = 0
            self.open = False

    def reset(self) -> None:
        self.failures = dict.fromkeys(self.failures, 0)
        self.down, self.open = 0, False

    def failure(self, url: str, error: str) -> None:
        self.failures[url] += 1
        self.last = error
        if self.threshold and self.failures[url] == self.threshold:
            self.down += 1
            self.open = self.down == len(self.failures)

    def check(self) -> None:
        if self.open:
            urls = list(self.failures)
            servers = f"server {urls[0]}" if len(urls) == 1 else "servers " + ", ".join(urls)
            raise EngineUnavailableError(
                f"SGLang {servers} unavailable: {sum(self.failures.values())} connection failures in a row, "
                f"the last: {self.last}; restart the server and rerun"
            )


class SGLangEngine(Engine):
    """Client of one or more SGLang servers (or one sglang-router); see the module docstring."""

    def __init__(
        self, urls: str | Sequence[str], *, config: SGLangConfig | None = None, seed: int | None = None
    ) -> None:
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u.strip()]
        self.urls = [u.strip().rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("SGLangEngine needs at least one server URL, e.g. http://127.0.0.1:30000")
        self.config = config or SGLangConfig()
        self.in_flight = {u: 0 for u in self.urls}
        self.breaker = _Breaker(self.urls, self.config.breaker_threshold)
        self._rng = random.Random(seed)
        self._next = 0  # round-robin start among equally loaded servers
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aborts: set[asyncio.Task] = set()
        self._closed_in: asyncio.AbstractEventLoop | None = None  # the loop close() ran in

    # ---- plumbing ---------------------------------------------------------------------------

    def _http(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._closed_in is loop:
            # A request still retrying after close() would open a session nobody closes.
            raise EngineError("the SGLang client was closed; make a new one (or use it from another event loop)")
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(
                limit=self.config.max_concurrency + CONTROL_CONNECTIONS, limit_per_host=0, ttl_dns_cache=300
            )
            self._session = aiohttp.ClientSession(connector=connector, json_serialize=json.dumps)
            self._sem = asyncio.Semaphore(self.config.max_concurrency)
            self._loop = loop
            self._aborts = set()
        return self._session, self._sem

    def _pick(self, avoid: str | None = None) -> str:
        candidates = [u for u in self.urls if u != avoid] or self.urls
        k = len(candidates)
        start = self._next % k
        self._next += 1
        order = candidates[start:] + candidates[:start]
        # A server refusing connections fails at once and so always looks least loaded: each of its failures in a
        # row counts as a fair share of requests in flight, so it gets traffic (and a chance to come back) only
        # when the others are busier than that.
        share = max(1, self.config.max_concurrency // len(self.urls))
        return min(order, key=lambda u: self.in_flight[u] + share * self.breaker.failures[u])

    async def _post(self, url: str, path: str, payload: dict[str, Any], timeout: aiohttp.ClientTimeout) -> Any:
        """One attempt; 2xx -> parsed JSON, 5xx/transport -> _Retryable, 4xx -> EngineError."""
        session, _ = self._http()
        try:
            body = encode_json(payload)
            async with session.post(url + path, data=body, headers=JSON_HEADERS, timeout=timeout) as resp:
                raw = await resp.read()
        except CONNECTION_FAILURES as e:
            raise _Retryable(_transport_error(e, url, path), connection=True) from e
        except asyncio.TimeoutError as e:  # sent, no answer in time: the server may still be generating
            raise _Retryable(_transport_error(e, url, path), may_run_on=True) from e
        except aiohttp.ClientError as e:  # a broken answer: the server is done with the request
            raise _Retryable(_transport_error(e, url, path)) from e
        self.breaker.alive(url)
        if resp.status >= 500:
            raise _Retryable(f"HTTP {resp.status} from {url}{path}: {_snippet(raw)}")
        if resp.status >= 400:
            raise _HTTPStatus(f"HTTP {resp.status} from {url}{path}: {_snippet(raw)}", resp.status)
        try:
            return decode_json(raw) if raw else {}
        except ValueError as e:
            raise _Retryable(f"non-JSON answer from {url}{path}: {_snippet(raw)}") from e

    def _abort_later(self, url: str, rid: str) -> None:
        """Post ``/abort_request`` for ``rid`` to ``url`` in the background; close() waits for it."""
        if self._closed_in is asyncio.get_running_loop():
            return  # closing cancelled the request; no session is left to send the abort with
        session, _ = self._http()
        task = asyncio.get_running_loop().create_task(self._abort(session, url, rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, session: aiohttp.ClientSession, url: str, rid: str) -> None:
        if session.closed:  # close() stopped waiting for it; a new session would leak
            log.debug("abort of %s on %s dropped: the engine is closed", rid, url)
            return
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.abort_timeout_s)
            async with session.post(url + "/abort_request", json={"rid": rid}, timeout=timeout) as resp:
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            # Best effort: the caller already has the error that made the attempt be abandoned.
            log.debug("abort of %s on %s failed: %s", rid, url, _transport_error(e, url, "/abort_request"))

    # ---- Engine API -------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None
    ) -> GenerateResult:
        rid = rid or uuid.uuid4().hex
        cfg = self.config
        payload = {
            "input_ids": list(input_ids),
            "sampling_params": sampling.to_json(),
            "return_logprob": True,
            "logprob_start_len": cfg.logprob_start_len,
        }
        if sampling.return_sampling_mask:  # a request-level key in SGLang, refused inside sampling_params
            payload["return_sampling_mask"] = True
        if sampling.return_routed_experts:  # request-level too; a server without the flag just omits the answer
            payload["return_routed_experts"] = True
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s)
        _, sem = self._http()
        breaker = self.breaker
        last_url: str | None = None
        errors: list[str] = []
        for attempt in range(cfg.max_retries + 1):
            breaker.check()
            if attempt:
                await asyncio.sleep(backoff_delay(attempt - 1, cfg.backoff_base_s, cfg.backoff_max_s, self._rng))
            server_rid = payload["rid"] = rid if attempt == 0 else f"retry{attempt}-{rid}"
            async with sem:
                breaker.check()  # it may have opened while this request waited for a slot or slept
                url = last_url = self._pick(avoid=last_url)
                self.in_flight[url] += 1
                try:
                    body = await self._post(url, "/generate", payload, timeout)
                except _Retryable as e:
                    errors.append(str(e))
                    if e.may_run_on:
                        self._abort_later(url, server_rid)
                    if e.connection:
                        breaker.failure(url, str(e))
                        breaker.check()
                    continue
                except EngineError as e:
                    raise EngineError(f"request {rid}: {e}") from e
                except asyncio.CancelledError:
                    self._abort_later(url, server_rid)
                    raise
                finally:
                    self.in_flight[url] -= 1
            if not isinstance(body, dict):
                raise EngineError(f"request {rid}: /generate answered {type(body).__name__}, expected one JSON object")
            try:
                return parse_response(body, rid=rid, sampling_mask=sampling.return_sampling_mask,
                                      routed_experts_of=len(input_ids) if sampling.return_routed_experts else None)
            except TransientAbortError as e:
                errors.append(f"{url}/generate aborted it with status_code {e.status_code} ({e.reason})")
        raise EngineError(f"request {rid}: gave up after {cfg.max_retries + 1} attempts; last error: {errors[-1]}")

    async def model_info(self) -> dict[str, Any]:
        return (await self._on_every_server(self._model_info))[0]

    async def health_check(self, sampling: SamplingParams | None = None) -> list[dict[str, Any]]:
        """``/health`` then ``/get_model_info`` on every server, with retries; one-line EngineError naming the
        first server that fails, or whose ``preferred_sampling_params`` differ from what requests with
        ``sampling`` (default: ``SamplingParams()``) send. Success closes the circuit breaker."""
        sampling = sampling or SamplingParams()

        async def check(url: str) -> dict[str, Any]:
            await self._get(url, "/health", want_json=False)
            info = await self._model_info(url)
            _check_preferred(url, info.get("preferred_sampling_params"), sampling)
            if sampling.return_sampling_mask:
                await self._check_sampling_mask(url, sampling)
            return info

        infos = await self._on_every_server(check)
        self.breaker.reset()
        return infos

    async def routed_experts_width(self, sampling: SamplingParams) -> int | None:
        """Expert ids per position (layers x top_k) every server returns for ``return_routed_experts``, or None when
        one returns none (SGLang sends ``meta_info.routed_experts`` only when started with
        ``--enable-return-routed-experts``; otherwise the key is absent, with no error): one request of one token
        each, whose answer covers one position. Servers that disagree are an :class:`EngineError`."""
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s)
        probe = dataclasses.replace(sampling, max_new_tokens=1, sampling_seed=0, return_sampling_mask=False)
        payload = {"input_ids": [0], "sampling_params": probe.to_json(), "return_logprob": True,
                   "return_routed_experts": True}

        async def width(url: str) -> int | None:
            try:
                body = await self._post(url, "/generate", payload, timeout)
                result = parse_response(body, rid="routed-experts-probe", routed_experts_of=1)
            except (_Retryable, EngineError) as e:
                raise EngineError(f"SGLang server {url}: a one-token return_routed_experts request failed: {e}") from e
            ids = result.routed_experts
            return None if ids is None or not len(ids) else int(ids.shape[1])

        widths = await self._on_every_server(width)
        if None in widths:
            return None
        if len(set(widths)) > 1:
            raise EngineError(f"the SGLang servers {self.urls} return routing of {widths} expert ids per position: "
                              "serve one model behind one engine spec")
        return widths[0]

    async def _check_sampling_mask(self, url: str, sampling: SamplingParams) -> None:
        """Refuse a top_k the server's ``--sampling-mask-max-tokens`` (``/get_server_info``) would refuse on every
        request. A server that does not report it (a router, another server) is not checked here: its refusals
        then fail the requests, and a response without the support is refused by the parser."""
        try:
            cap = (await self._get(url, "/get_server_info")).get("sampling_mask_max_tokens")
        except (EngineError, AttributeError) as e:
            log.debug("no sampling_mask_max_tokens from %s: %s", url, e)
            return
        if not isinstance(cap, int) or isinstance(cap, bool):
            return
        problem = sampling_mask_problem(sampling, cap)
        if problem:
            raise EngineSettingsError(f"SGLang server {url} refuses return_sampling_mask here: {problem}")

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> list[dict[str, Any]]:
        """Load a checkpoint on every server; raises unless all report success.

        Without ``weight_version``, a rollshard checkpoint's own version (its ``trainer_state.json``, when the
        folder is visible here) is sent, so rows generated from it carry the trainer's version of it."""
        if weight_version is None:
            try:
                weight_version = folder_weight_version(model_path)
            except VersionError as e:
                raise EngineError(str(e)) from e
        payload: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._post_all("/update_weights_from_disk", payload)

    async def update_weight_version(self, new_version: str) -> list[dict[str, Any]]:
        return await self._post_all("/update_weight_version", {"new_version": str(new_version)})

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        self._closed_in = loop
        if self._aborts and self._loop is loop:
            # Each abort is bounded by its own timeout; the margin covers their start-up, not a hang.
            await asyncio.wait(set(self._aborts), timeout=self.config.abort_timeout_s + 1.0)
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # ---- control-plane helpers ----------------------------------------------------------------

    async def _on_every_server(self, fn: Callable[[str], Awaitable[Any]]) -> list[Any]:
        tasks = [asyncio.ensure_future(fn(u)) for u in self.urls]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # one server failed: stop retrying the others
                t.cancel()

    async def _model_info(self, url: str) -> dict[str, Any]:
        info = await self._get(url, "/get_model_info")
        if not isinstance(info, dict):
            raise EngineError(
                f"SGLang server {url}: GET /get_model_info answered {type(info).__name__}, not a JSON object; "
                "check that the URL points at an SGLang server"
            )
        return info

    async def _get(self, url: str, path: str, *, want_json: bool = True) -> Any:
        """GET with the retries of /generate: connection errors, timeouts and 5xx are retried, a 4xx is not."""
        session, _ = self._http()
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.health_timeout_s)
        attempts = cfg.max_retries + 1
        failure, cause = "", None
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(backoff_delay(attempt - 1, cfg.backoff_base_s, cfg.backoff_max_s, self._rng))
            try:
                async with session.get(url + path, timeout=timeout) as resp:
                    raw = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                reason = f"{type(e).__name__}: {e}".rstrip(": ")
                failure = (
                    f"SGLang server {url} unreachable after {attempts} attempts (GET {path}: {reason}); "
                    "start it or fix the URL"
                )
                cause = e
                continue
            if resp.status >= 500:
                failure = (
                    f"SGLang server {url} is not healthy: GET {path} answered HTTP {resp.status} "
                    f"{attempts} times, the last: {_snippet(raw)}; wait until it has started, or restart it"
                )
                cause = None
                continue
            if resp.status != 200:
                raise EngineError(
                    f"SGLang server {url} is not healthy: GET {path} answered HTTP {resp.status}: {_snippet(raw)}; "
                    "check that the URL points at an SGLang server"
                )
            if not want_json:
                return raw.decode(errors="replace")
            try:
                return json.loads(raw)
            except ValueError as e:
                raise EngineError(
                    f"SGLang server {url}: GET {path} answered non-JSON: {_snippet(raw)}; "
                    "check that the URL points at an SGLang server"
                ) from e
        raise EngineError(failure) from cause

    async def _post_all(self, path: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """POST a control request to every server; a router that does not forward it (a 404, as sglang-router
        0.3.2 answers ``/update_weights_from_disk`` and ``/update_weight_version``) is replaced by the workers it
        lists on ``GET /workers``, each sent the request directly, with a warning saying so. One answer per server
        (per worker behind such a router)."""
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s)

        async def one(url: str) -> dict[str, Any]:
            try:
                out = await self._post(url, path, payload, timeout)
            except (_Retryable, EngineError) as e:
                raise EngineError(f"POST {path} failed on {url}: {e}") from e
            if isinstance(out, dict) and out.get("success") is False:
                raise EngineError(f"POST {path} failed on {url}: {out.get('message')}")
            return out

        async def server(url: str) -> list[dict[str, Any]]:
            try:
                return [await one(url)]
            except EngineError as e:
                if not (isinstance(e.__cause__, _HTTPStatus) and e.__cause__.status == 404):
                    raise
                workers = await self._router_workers(url)
                if workers is None:
                    raise
            if not workers:
                raise EngineError(f"POST {path}: the router {url} does not forward it and lists no workers (GET /workers)")
            log.warning(
                "%s does not forward POST %s (HTTP 404: an sglang-router); sent it to its %d workers directly: %s",
                url, path, len(workers), ", ".join(workers),
            )
            return list(await asyncio.gather(*(one(w) for w in workers)))

        return [out for outs in await asyncio.gather(*(server(u) for u in self.urls)) for out in outs]

    async def _router_workers(self, url: str) -> list[str] | None:
        """The worker URLs an sglang-router lists on ``GET /workers``; None when ``url`` is not such a router."""
        try:
            listing = await self._get(url, "/workers")
        except EngineError:
            return None
        if not (isinstance(listing, dict) and isinstance(listing.get("workers"), list)):
            return None
        urls = [w.get("url") for w in listing["workers"] if isinstance(w, dict)]
        return [u.rstrip("/") for u in urls if isinstance(u, str) and u]


def sampling_mask_problem(sampling: SamplingParams, cap: int = SGLANG_SAMPLING_MASK_MAX_TOKENS) -> str | None:
    """Why an SGLang server with ``--sampling-mask-max-tokens cap`` refuses ``return_sampling_mask`` for these
    parameters (HTTP 400 on every request), None when it accepts them. SGLang 0.5.23's rule, measured: greedy
    (which it runs as top_k 1) or a finite ``1 <= top_k <= cap``; a top-p alone is refused."""
    if sampling.temperature < GREEDY_TEMPERATURE_EPS or 1 <= sampling.top_k <= cap:
        return None
    have = "no --top-k" if sampling.top_k < 1 else f"--top-k {sampling.top_k}"
    return (
        f"it needs a top-k of at most its --sampling-mask-max-tokens ({cap}) to return the sampling support, "
        f"and this run has {have}; add --top-k K (K <= {cap}) or pass --sampling-support off"
    )


def _check_preferred(url: str, preferred: Any, sampling: SamplingParams) -> None:
    diffs = preferred_sampling_differences(preferred, sampling)
    if diffs is None:
        raise EngineSettingsError(
            f"SGLang server {url} reports preferred_sampling_params {preferred!r}, not a JSON object; "
            "restart it without --preferred-sampling-params"
        )
    if diffs:
        raise EngineSettingsError(
            f"SGLang server {url} has --preferred-sampling-params that change what this client samples: "
            f"{', '.join(diffs)}; restart it without --preferred-sampling-params"
        )


def _transport_error(e: BaseException, url: str, path: str) -> str:
    return f"{type(e).__name__} talking to {url}{path}: {e}".rstrip(": ")


def _snippet(raw: bytes, limit: int = 300) -> str:
    text = raw.decode(errors="replace").strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."

"""SGLang native-API client: ``POST /generate`` with ``input_ids`` and ``return_logprob``, strictly parsed.

One pooled aiohttp session per event loop, bounded concurrency, several server URLs
(each request goes to the one with the fewest requests in flight) or one
sglang-router URL. Connection errors, timeouts and 5xx answers are retried with
exponential backoff and jitter, preferring another server; a 4xx is the caller's
fault and fails at once. :meth:`SGLangEngine.health_check` asks every server for
``/health`` and ``/get_model_info`` and fails with one line naming the first that
does not answer.

The response must carry one logprob per response token. A missing or short
``meta_info.output_token_logprobs`` on a response that did not abort, a logprob
that is not a finite float, or token ids in the logprobs that disagree with
``output_ids`` raise :class:`EngineError` naming the request: a response without
its logprobs is never returned (slime issue #1976 / PR #1995). An aborted response
(``finish_reason.type == "abort"``) keeps the tokens that have a logprob, and its
weight-version spans are clipped to them; when that drops tokens, its text becomes
the kept tokens' texts from the logprob items when the server sent them
(``return_text_in_logprobs``), else empty: the server's text covers tokens that are
not kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import uuid
from typing import Any, Sequence

import aiohttp
import numpy as np

from rollshard.generate.engines.base import Engine, EngineError, GenerateResult, SamplingParams
from rollshard.store.schema import WeightSpan

FINISH_TYPES = ("stop", "length", "abort")
# A logprob is <= 0 mathematically; GPU kernels can round a near-certain token's to a hair above 0.
# Such values are stored as 0.0; anything larger means the server sent something else (e.g. a logit).
POSITIVE_LOGPROB_TOL = 1e-4


@dataclasses.dataclass(kw_only=True)
class SGLangConfig:
    """Client settings; the defaults suit one GPU server and a runner keeping a few hundred requests in flight."""

    max_concurrency: int = 256  # requests in flight over all URLs
    request_timeout_s: float = 600.0  # whole request, connect to last byte
    connect_timeout_s: float = 10.0
    max_retries: int = 4  # attempts after the first, on connection errors, timeouts and 5xx
    backoff_base_s: float = 0.5  # first retry waits about this long, then doubles
    backoff_max_s: float = 30.0
    health_timeout_s: float = 5.0
    logprob_start_len: int = -1  # SGLang: -1 computes no input-token logprobs


class _Retryable(Exception):
    """A transient failure of one attempt (connection, timeout, 5xx)."""


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Exponential backoff with "equal jitter": half the step fixed, half uniform. ``attempt`` counts from 0."""
    step = min(cap, base * 2**attempt)
    return step / 2 + (rng or random).uniform(0, step / 2)


def parse_response(body: dict[str, Any], *, rid: str) -> GenerateResult:
    """Validate one ``/generate`` response and turn it into a :class:`GenerateResult` (see module docstring)."""
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(f"request {rid}: response has no meta_info object")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
        raise EngineError(f"request {rid}: finish_reason {finish!r} is not one of {FINISH_TYPES}")
    kind = finish["type"]
    aborted = kind == "abort"

    items = meta.get("output_token_logprobs")
    output_ids = body.get("output_ids")
    if items is None and not aborted:
        raise EngineError(
            f"request {rid}: response has no meta_info.output_token_logprobs "
            "(was return_logprob dropped by a proxy?); refusing a response without its logprobs"
        )
    items = items or []
    if not isinstance(items, list):
        raise EngineError(f"request {rid}: output_token_logprobs is {type(items).__name__}, expected a list")

    try:
        lp_raw, lp_ids = ([it[0] for it in items], [it[1] for it in items]) if items else ([], [])
        lps = np.asarray(lp_raw, dtype=np.float64)  # None -> nan, rejected below
    except (TypeError, IndexError, KeyError, ValueError) as e:
        raise EngineError(f"request {rid}: output_token_logprobs items must be [logprob, token_id, text]: {e}") from e
    bad = ~(np.isfinite(lps) & (lps <= POSITIVE_LOGPROB_TOL))
    if bad.any():
        pos = int(np.argmax(bad))
        raise EngineError(
            f"request {rid}: logprob of response token {pos} is {lp_raw[pos]!r}, expected a finite float <= 0"
        )
    logprobs = np.minimum(lps, 0.0).tolist()

    completion = meta.get("completion_tokens")
    if output_ids is None:
        output_ids = lp_ids
    if not isinstance(output_ids, list):
        raise EngineError(f"request {rid}: output_ids is {type(output_ids).__name__}, expected a list")
    if not aborted:
        expected = len(output_ids) if completion is None else int(completion)
        if len(output_ids) != expected or len(logprobs) != expected:
            raise EngineError(
                f"request {rid}: {len(logprobs)} logprobs for {expected} response tokens "
                f"(output_ids has {len(output_ids)}); refusing a response with missing logprobs"
            )
    sent = len(output_ids)
    text = body.get("text") or ""
    if aborted:
        # An abort may stop between sending a token and its logprob: keep the prefix that has both.
        n = min(len(output_ids), len(logprobs))
        output_ids, logprobs, lp_ids = output_ids[:n], logprobs[:n], lp_ids[:n]
        if n < sent:
            pieces = [it[2] if len(it) > 2 else None for it in items[:n]]
            text = "".join(pieces) if all(isinstance(p, str) for p in pieces) else ""
    if output_ids != lp_ids:
        pos = next(i for i, (a, b) in enumerate(zip(output_ids, lp_ids)) if a != b)
        raise EngineError(
            f"request {rid}: output_ids[{pos}] = {output_ids[pos]} but output_token_logprobs[{pos}] names token "
            f"{lp_ids[pos]}; ids and logprobs disagree"
        )

    n = len(output_ids)
    version = meta.get("weight_version")
    version = None if version is None else str(version)
    spans = _weight_spans(meta.get("weight_versions"), n, sent=sent) or (
        [WeightSpan(version=version, start=0, end=n)] if version is not None else None
    )
    known = {
        "finish_reason",
        "output_token_logprobs",
        "weight_version",
        "weight_versions",
        "prompt_tokens",
        "completion_tokens",
    }
    return GenerateResult(
        output_ids=output_ids,
        logprobs=logprobs,
        text=text,
        finish_reason=kind,
        finish_detail={k: v for k, v in finish.items() if k != "type"},
        weight_version=version if version is not None else (spans[-1].version if spans else None),
        weight_versions=spans,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=n,
        meta={k: v for k, v in meta.items() if k not in known and k != "input_token_logprobs"},
    )


def _weight_spans(raw: Any, n: int, *, sent: int | None = None) -> list[WeightSpan] | None:
    """SGLang's per-response weight version record: spans ``[{version, start, end}]`` or one version per token,
    for the ``n`` tokens kept of the ``sent`` in ``output_ids`` (an abort keeps fewer): spans starting at or
    after ``n`` are dropped and the others end at ``n`` at most."""
    if not raw or not isinstance(raw, list):
        return None
    if all(isinstance(s, dict) for s in raw):
        spans = [WeightSpan(version=str(s["version"]), start=int(s["start"]), end=int(s["end"])) for s in raw]
        return _clip_spans(spans, n)
    if all(isinstance(s, (list, tuple)) and len(s) == 3 for s in raw):  # msgspec array form [version, start, end]
        return _clip_spans([WeightSpan(version=str(v), start=int(a), end=int(b)) for v, a, b in raw], n)
    if len(raw) in (n, sent):  # one version per token: compress into spans
        spans: list[WeightSpan] = []
        for i, v in enumerate(raw[:n]):
            if spans and spans[-1].version == str(v):
                spans[-1].end = i + 1
            else:
                spans.append(WeightSpan(version=str(v), start=i, end=i + 1))
        return spans or None
    return None


def _clip_spans(spans: list[WeightSpan], n: int) -> list[WeightSpan] | None:
    """The spans restricted to tokens ``[0, n)``; None when none is left."""
    kept = [WeightSpan(version=s.version, start=s.start, end=min(s.end, n)) for s in spans if s.start < n]
    return kept or None


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
        self._rng = random.Random(seed)
        self._next = 0  # round-robin start among equally loaded servers
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- plumbing ---------------------------------------------------------------------------

    def _http(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(limit=self.config.max_concurrency, limit_per_host=0, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector, json_serialize=json.dumps)
            self._sem = asyncio.Semaphore(self.config.max_concurrency)
            self._loop = loop
        return self._session, self._sem

    def _pick(self, avoid: str | None = None) -> str:
        candidates = [u for u in self.urls if u != avoid] or self.urls
        k = len(candidates)
        start = self._next % k
        self._next += 1
        order = candidates[start:] + candidates[:start]
        return min(order, key=lambda u: self.in_flight[u])

    async def _post(self, url: str, path: str, payload: dict[str, Any], timeout: aiohttp.ClientTimeout) -> Any:
        """One attempt; 2xx -> parsed JSON, 5xx/transport -> _Retryable, 4xx -> EngineError."""
        session, _ = self._http()
        try:
            async with session.post(url + path, json=payload, timeout=timeout) as resp:
                raw = await resp.read()
                if resp.status >= 500:
                    raise _Retryable(f"HTTP {resp.status} from {url}{path}: {_snippet(raw)}")
                if resp.status >= 400:
                    raise EngineError(f"HTTP {resp.status} from {url}{path}: {_snippet(raw)}")
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            raise _Retryable(f"{type(e).__name__} talking to {url}{path}: {e}".rstrip(": ")) from e
        try:
            return json.loads(raw) if raw else {}
        except ValueError as e:
            raise _Retryable(f"non-JSON answer from {url}{path}: {_snippet(raw)}") from e

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
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        _, sem = self._http()
        last_url: str | None = None
        errors: list[str] = []
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(backoff_delay(attempt - 1, cfg.backoff_base_s, cfg.backoff_max_s, self._rng))
            # A retried request gets a fresh server-side id: the first attempt may still be running there.
            payload["rid"] = rid if attempt == 0 else f"{rid}.retry{attempt}"
            async with sem:
                url = last_url = self._pick(avoid=last_url)
                self.in_flight[url] += 1
                try:
                    body = await self._post(url, "/generate", payload, timeout)
                except _Retryable as e:
                    errors.append(str(e))
                    continue
                except EngineError as e:
                    raise EngineError(f"request {rid}: {e}") from e
                finally:
                    self.in_flight[url] -= 1
            if not isinstance(body, dict):
                raise EngineError(f"request {rid}: /generate answered {type(body).__name__}, expected one JSON object")
            return parse_response(body, rid=rid)
        raise EngineError(f"request {rid}: gave up after {cfg.max_retries + 1} attempts; last error: {errors[-1]}")

    async def model_info(self) -> dict[str, Any]:
        return (await self._get_all("/get_model_info"))[0]

    async def health_check(self) -> list[dict[str, Any]]:
        """``/health`` then ``/get_model_info`` on every server; one-line EngineError naming the first failure."""
        await self._get_all("/health", want_json=False)
        return await self._get_all("/get_model_info")

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> list[dict[str, Any]]:
        """Load a checkpoint on every server; raises unless all report success."""
        payload: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._post_all("/update_weights_from_disk", payload)

    async def update_weight_version(self, new_version: str) -> list[dict[str, Any]]:
        return await self._post_all("/update_weight_version", {"new_version": str(new_version)})

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # ---- control-plane helpers ----------------------------------------------------------------

    async def _get_all(self, path: str, *, want_json: bool = True) -> list[Any]:
        session, _ = self._http()
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)

        async def one(url: str) -> Any:
            try:
                async with session.get(url + path, timeout=timeout) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        raise EngineError(
                            f"SGLang server {url} is not healthy: GET {path} answered HTTP {resp.status}: {_snippet(raw)}"
                        )
                    return json.loads(raw) if want_json else raw.decode(errors="replace")
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
                reason = f"{type(e).__name__}: {e}".rstrip(": ")
                raise EngineError(
                    f"SGLang server {url} unreachable (GET {path}: {reason}); start it or fix the URL"
                ) from e

        return list(await asyncio.gather(*(one(u) for u in self.urls)))

    async def _post_all(self, path: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, connect=self.config.connect_timeout_s)

        async def one(url: str) -> dict[str, Any]:
            try:
                out = await self._post(url, path, payload, timeout)
            except (_Retryable, EngineError) as e:
                raise EngineError(f"POST {path} failed on {url}: {e}") from e
            if isinstance(out, dict) and out.get("success") is False:
                raise EngineError(f"POST {path} failed on {url}: {out.get('message')}")
            return out

        return list(await asyncio.gather(*(one(u) for u in self.urls)))


def _snippet(raw: bytes, limit: int = 300) -> str:
    text = raw.decode(errors="replace").strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."

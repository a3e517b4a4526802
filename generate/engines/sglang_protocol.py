"""What an SGLang server sends, and what it means: strict parsing of ``/generate`` answers and model info.

Pure functions, no I/O; the client (:mod:`.sglang`) decides what to do with the errors.

* :func:`parse_response` validates one ``/generate`` answer (see :mod:`.sglang` for the rules) and
  raises :class:`TransientAbortError` for an abort the server means as "try again".
* :func:`preferred_sampling_differences` compares a server's ``--preferred-sampling-params``
  with what the client sends.

Aborts, as SGLang 0.5.x produces them (``FINISH_ABORT(message, status_code, err_type)`` in
``managers/schedule_batch.py``): a client's ``/abort_request`` and ``abort_all`` (weight updates with
``abort_all_requests``, ``/pause_generation`` in abort mode) carry no status code; request errors carry
400 / ``BadRequestError`` (invalid stop regex, sampling-support overflow); server-side failures carry 500
(``InternalServerError``: grammar, sampler or out-of-memory failures) or 503 (retraction without a
KV backup, waiting/running timeouts, a failed KV-cache load). A status code >= 500 therefore says the
request did not fail for a reason of its own: it is transient and retried; every other abort is final.
SGLang >= 0.5.x turns status-coded aborts of non-streaming requests into HTTP errors itself; an older
server, or a proxy in between, passes them as a 200 answer, which is why the body is checked too.
"""

from __future__ import annotations

import base64

import json
from typing import Any

import numpy as np

try:  # 3-5x faster than json on a response of a few hundred [logprob, id, null] items; optional
    import orjson
except ImportError:  # pragma: no cover - json does the same, slower
    orjson = None

from rollshard.generate.engines.base import EngineError, GenerateResult, SamplingParams
from rollshard.store.format.schema import SAMPLING_LOGPROB_TOL, WeightSpan

FINISH_TYPES = ("stop", "length", "abort")
# A logprob is <= 0 mathematically; GPU kernels can round a near-certain token's to a hair above 0.
# Such values are stored as 0.0; anything larger means the server sent something else (e.g. a logit).
POSITIVE_LOGPROB_TOL = 1e-4
_KNOWN_META = frozenset(
    {
        "finish_reason",
        "output_token_logprobs",
        "input_token_logprobs",
        "weight_version",
        "weight_versions",
        "prompt_tokens",
        "completion_tokens",
        "output_token_sampling_mask",
        "output_token_sampling_logprobs",
        "output_token_sampling_mask_length",
        "routed_experts",  # decoded into the result (a multi-MB string is not kept twice)
    }
)


def encode_json(obj: Any) -> bytes:
    """A request body. orjson where installed; json for what orjson refuses (integers beyond 64 bits, which the
    server then refuses with a message of its own)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except TypeError:
            pass
    return json.dumps(obj).encode()


def decode_json(raw: bytes) -> Any:
    """A response body; ValueError when it is not JSON. orjson where installed; json for what orjson refuses but
    json reads (NaN, Infinity, integers beyond 64 bits), so such a body fails the response's checks by name."""
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


class TransientAbortError(EngineError):
    """The server aborted the request with a 5xx status code: its own failure, so the request is retried."""

    def __init__(self, rid: str, status_code: int, message: str) -> None:
        super().__init__(f"request {rid}: the server aborted it with status_code {status_code} ({message})")
        self.status_code = status_code
        self.reason = message


def abort_status(finish: dict[str, Any]) -> int | None:
    """The HTTP-like status code of an abort finish_reason, None when it has none (or not a number)."""
    code = finish.get("status_code")
    if code is None or isinstance(code, bool):
        return None
    try:
        return int(code)
    except (TypeError, ValueError):
        return None


def parse_response(body: dict[str, Any], *, rid: str, sampling_mask: bool = False,
                   routed_experts_of: int | None = None) -> GenerateResult:
    """Validate one ``/generate`` response and turn it into a :class:`GenerateResult` (see :mod:`.sglang`).

    ``sampling_mask``: the request asked for ``return_sampling_mask``; the response must then carry one
    support and one sampling logprob per response token (:func:`_sampling_support`).

    ``routed_experts_of``: the request asked for ``return_routed_experts`` with this many input tokens; the
    result carries the routing the server sent (:func:`_routed_experts`), None where it sent none.

    ``meta["weight_versions_sent"]`` is the server's ``weight_versions`` as sent (None when it sent
    none: the result's single span was then made from ``weight_version``)."""
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(f"request {rid}: response has no meta_info object")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
        raise EngineError(f"request {rid}: finish_reason {finish!r} is not one of {FINISH_TYPES}")
    kind = finish["type"]
    aborted = kind == "abort"
    if aborted:
        code = abort_status(finish)
        if code is not None and code >= 500:
            raise TransientAbortError(rid, code, str(finish.get("message") or "no message"))

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
    supports, sampling_lps = _sampling_fields(meta, rid, asked=sampling_mask, aborted=aborted)
    if sampling_mask and not aborted and not len(supports) == len(sampling_lps) == len(output_ids):
        raise EngineError(
            f"request {rid}: {len(supports)} sampling supports and {len(sampling_lps)} sampling logprobs for "
            f"{len(output_ids)} response tokens; refusing a response with a missing sampling support"
        )
    sent = len(output_ids)
    text = body.get("text") or ""
    if aborted:
        # An abort may stop between sending a token and its logprob (or support): keep the prefix that has all.
        n = min(len(output_ids), len(logprobs), *((len(supports), len(sampling_lps)) if sampling_mask else ()))
        output_ids, logprobs, lp_ids = output_ids[:n], logprobs[:n], lp_ids[:n]
        supports, sampling_lps = supports[:n], sampling_lps[:n]
        if n < sent:
            pieces = [it[2] if len(it) > 2 else None for it in items[:n]]
            text = "".join(pieces) if all(isinstance(p, str) for p in pieces) else ""
    if output_ids != lp_ids:
        pos = next(i for i, (a, b) in enumerate(zip(output_ids, lp_ids)) if a != b)
        raise EngineError(
            f"request {rid}: output_ids[{pos}] = {output_ids[pos]} but output_token_logprobs[{pos}] names token "
            f"{lp_ids[pos]}; ids and logprobs disagree"
        )

    if sampling_mask:
        sampling_lps = _check_support(rid, output_ids, logprobs, supports, sampling_lps)
    n = len(output_ids)
    version = meta.get("weight_version")
    version = None if version is None else str(version)
    raw_spans = meta.get("weight_versions")
    spans = _weight_spans(raw_spans, n, sent=sent) or (
        [WeightSpan(version=version, start=0, end=n)] if version is not None else None
    )
    extra = {k: v for k, v in meta.items() if k not in _KNOWN_META}
    extra["weight_versions_sent"] = raw_spans
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
        meta=extra,
        sampling_logprobs=sampling_lps if sampling_mask else None,
        sampling_support=supports if sampling_mask else None,
        routed_experts=(None if routed_experts_of is None else
                        _routed_experts(meta.get("routed_experts"), rid, routed_experts_of, sent, n)),
    )


def _routed_experts(raw: Any, rid: str, input_len: int, sent: int, kept: int) -> np.ndarray | None:
    """SGLang's ``meta_info.routed_experts`` (0.5.23, ``--enable-return-routed-experts``): base64 of the
    little-endian int32 ids ``[input + output - 1, layers, top_k]`` (every position forwarded but the last output
    token), sent when the request finishes. Returned as ``[positions, layers x top_k]`` (the client does not know
    the model's layers), cut to the ``kept`` output tokens of an abort; None when the server sent none (no
    ``--enable-return-routed-experts``, or a request aborted in its queue)."""
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise EngineError(f"request {rid}: meta_info.routed_experts is {type(raw).__name__}, expected a base64 string")
    try:
        ids = np.frombuffer(base64.b64decode(raw, validate=True), "<i4")
    except (ValueError, TypeError) as e:  # binascii.Error is a ValueError; a length not a multiple of 4 too
        raise EngineError(f"request {rid}: meta_info.routed_experts is not base64 of int32 ids: {e}") from e
    rows = max(input_len + sent - 1, 0)
    if rows == 0 and ids.size == 0:
        return None  # nothing was forwarded before the answer: no routing (as for an abort in the queue)
    if rows == 0 or ids.size % rows or not ids.size:
        raise EngineError(
            f"request {rid}: meta_info.routed_experts holds {ids.size} ids, not a whole number of rows for the "
            f"{rows} positions forwarded ({input_len} input + {sent} output tokens - 1)"
        )
    if ids.min() < 0:
        raise EngineError(f"request {rid}: meta_info.routed_experts holds a negative expert id")
    return ids.reshape(rows, -1)[: max(input_len + kept - 1, 0)]


def _sampling_fields(meta: dict[str, Any], rid: str, *, asked: bool, aborted: bool) -> tuple[list, list]:
    """``output_token_sampling_mask`` and ``output_token_sampling_logprobs`` as sent (empty when not asked).

    Asked for and missing on a response that did not abort: refused like missing logprobs (an older server,
    or a proxy that drops the top-level ``return_sampling_mask``)."""
    if not asked:
        return [], []
    supports, lps = meta.get("output_token_sampling_mask"), meta.get("output_token_sampling_logprobs")
    if (supports is None or lps is None) and not aborted:
        raise EngineError(
            f"request {rid}: response has no meta_info.output_token_sampling_mask/output_token_sampling_logprobs "
            "although return_sampling_mask was sent (SGLang >= 0.5.23 returns them; was it dropped by a proxy?); "
            "refusing a response without its sampling support"
        )
    supports, lps = supports or [], lps or []
    if not (isinstance(supports, list) and isinstance(lps, list)):
        raise EngineError(f"request {rid}: output_token_sampling_mask and output_token_sampling_logprobs must be lists")
    return supports, lps


def _check_support(
    rid: str, output_ids: list[int], logprobs: list[float], supports: list, sampling_lps: list
) -> list[float]:
    """Each token's support is a list of distinct ids holding the token; its sampling logprob is finite, at
    most :data:`POSITIVE_LOGPROB_TOL` (stored as 0.0 above 0, like logprobs) and at least the full logprob
    minus ``SAMPLING_LOGPROB_TOL`` (truncation only removes mass; the tolerance is fp32 rounding of two
    log-softmaxes, the store's bound). Returns the sampling logprobs as floats."""
    for pos, (tok, support) in enumerate(zip(output_ids, supports)):
        if not (isinstance(support, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in support)):
            raise EngineError(f"request {rid}: sampling support of response token {pos} is {support!r}, not a list of ids")
        if tok not in support:  # a boolean mask over the vocabulary would land here too: SGLang sends ids
            raise EngineError(
                f"request {rid}: response token {pos} (id {tok}) is not in its sampling support "
                f"({len(support)} ids); refusing a response whose support does not hold the sampled token"
            )
        if len(set(support)) != len(support):
            raise EngineError(f"request {rid}: sampling support of response token {pos} names an id twice")
    try:
        slps = np.asarray(sampling_lps, dtype=np.float64)  # None -> nan, rejected below
    except (TypeError, ValueError) as e:
        raise EngineError(f"request {rid}: output_token_sampling_logprobs must be numbers: {e}") from e
    if slps.ndim != 1:
        raise EngineError(f"request {rid}: output_token_sampling_logprobs must be one number per token")
    full = np.asarray(logprobs, dtype=np.float64)
    bad = ~(np.isfinite(slps) & (slps <= POSITIVE_LOGPROB_TOL) & (slps >= full - SAMPLING_LOGPROB_TOL))
    if bad.any():
        pos = int(np.argmax(bad))
        raise EngineError(
            f"request {rid}: sampling logprob of response token {pos} is {sampling_lps[pos]!r} with full logprob "
            f"{logprobs[pos]:.6g}; expected a finite float <= 0 and >= the full logprob (truncation only removes mass)"
        )
    return np.minimum(slps, 0.0).tolist()


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


def preferred_sampling_differences(preferred: Any, sampling: SamplingParams) -> list[str] | None:
    """The keys of a server's ``preferred_sampling_params`` that would change what the client samples.

    SGLang fills every sampling parameter a request leaves out from ``--preferred-sampling-params``
    (``{**preferred, **request}`` in the tokenizer manager), and ``/get_model_info`` reports them as an
    object (a JSON string when set through the Python API) or null. A key the client sends wins over
    the server's, whatever its value, so only the keys the client does not send count: the server would
    apply them, even where the client has no opinion. Returns None when the report is not an object."""
    if isinstance(preferred, str):
        try:
            preferred = json.loads(preferred) if preferred.strip() else None
        except ValueError:
            return None
    if preferred is None:
        return []
    if not isinstance(preferred, dict):
        return None
    sent = sampling.to_json()
    return [f"{key}={preferred[key]!r} (client sends none)" for key in sorted(preferred) if key not in sent]

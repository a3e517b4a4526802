"""Validation of ``rollshard-generate serve``'s request bodies: hostile input is a 400 naming the field, never a 500.

:func:`parse_generate` turns a ``/generate`` body into a :class:`GenerateRequest` or
raises :class:`RequestError`. Ranges mirror SGLang's ``SamplingParams.verify``:
temperature finite and >= 0, 0 < top_p <= 1, top_k -1 (off) or >= 1 (0 is refused, as
SGLang refuses it), max_new_tokens an integer >= 0 (null is refused: SGLang reads it as
"up to the context", which the embedded engine does not implement). Types are strict:
a boolean is refused where a number is expected (``True == 1`` in Python), and a number
where a boolean is. SGLang parameters the engine does not implement are accepted only
at their neutral value (:data:`NEUTRAL_SAMPLING`); ``ignore_eos`` (a boolean) is SGLang's: no token ends
the request, neither an eos nor ``stop_token_ids``. Departures from SGLang, to keep the
worker cheap for everyone: at most :data:`MAX_STOP_STRINGS` stop strings of at most
:data:`MAX_STOP_CHARS` characters, and sampling_seed in [0, 2**63).

``return_sampling_mask`` (top level, as SGLang's): SGLang's rule, measured on 0.5.23: the request must be
greedy (temperature 0, which SGLang runs as top_k 1) or have a finite ``1 <= top_k <=``
:data:`SAMPLING_MASK_MAX_TOKENS`; a top-p alone is a 400. Only ``sampling_logprobs_mode`` ``"selected"``
(the default) is supported.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rollshard.generate.engines.base import NEUTRAL_SAMPLING as ENGINE_NEUTRAL_SAMPLING
from rollshard.generate.engines.base import SamplingParams
from rollshard.store.format.schema import GREEDY_TEMPERATURE_EPS

# The SGLang client sends base's neutral keys with every request; other clients may send these too.
NEUTRAL_SAMPLING: dict[str, Any] = {
    **ENGINE_NEUTRAL_SAMPLING,
    "n": 1,
    "spaces_between_special_tokens": True,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
    "custom_params": None,
}
MAX_STOP_STRINGS = 64  # each is checked against the decoded tail at every step of the request
MAX_STOP_CHARS = 256  # the tail decoded for a stop string grows with its length (4 tokens a character)
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
MAX_SEED = 2**63  # torch generators take a 64-bit seed; the runner's seeds are 31-bit
# SGLang's default --sampling-mask-max-tokens: the largest top_k a return_sampling_mask request may use.
SAMPLING_MASK_MAX_TOKENS = 4096


class RequestError(ValueError):
    """A request body the server refuses (HTTP 400); the message names the field."""


@dataclasses.dataclass(kw_only=True)
class GenerateRequest:
    input_ids: list[int] | None  # exactly one of input_ids and text
    text: str | None
    sampling: SamplingParams
    rid: str | None
    return_logprob: bool
    return_sampling_mask: bool = False
    return_routed_experts: bool = False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))  # JSON parsers take NaN and Infinity
    except OverflowError:  # an integer beyond any float
        return False


def _bool(body: dict[str, Any], key: str, default: bool, where: str = "") -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise RequestError(f"{where}{key} must be true or false, got {v!r}")
    return v


def _neutral_ok(v: Any, neutral: Any) -> bool:
    if neutral is None or isinstance(neutral, bool):
        return v is neutral
    return _is_number(v) and v == neutral


def parse_sampling(raw: Any) -> SamplingParams:
    """``sampling_params`` -> SamplingParams, or RequestError naming the field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be a JSON object, got {type(raw).__name__}")
    # return_sampling_mask is a request-level key in SGLang, unknown inside sampling_params (400 there too).
    fields = {f.name for f in dataclasses.fields(SamplingParams)} - {"return_sampling_mask", "return_routed_experts"}
    unsupported = sorted(k for k in raw if k not in fields and k not in NEUTRAL_SAMPLING)
    if unsupported:
        names = ", ".join(f"sampling_params.{k}" for k in unsupported)
        raise RequestError(f"{names}: not a sampling parameter the embedded engine supports")
    for key, neutral in NEUTRAL_SAMPLING.items():
        if key in raw and not _neutral_ok(raw[key], neutral):
            raise RequestError(
                f"sampling_params.{key} = {raw[key]!r} is not supported by the embedded engine; "
                f"send {neutral!r} or leave it out"
            )
    default = SamplingParams()
    where = "sampling_params."
    out: dict[str, Any] = {}

    t = raw.get("temperature", default.temperature)
    if not (_is_number(t) and t >= 0):
        raise RequestError(f"{where}temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
    p = raw.get("top_p", default.top_p)
    if not (_is_number(p) and 0 < p <= 1):
        raise RequestError(f"{where}top_p must be a number in (0, 1], got {p!r}")
    k = raw.get("top_k", default.top_k)
    if not (_is_int(k) and (k == -1 or k >= 1)):
        raise RequestError(f"{where}top_k must be -1 (no top-k) or an integer >= 1, got {k!r}")
    n = raw.get("max_new_tokens", default.max_new_tokens)
    if not (_is_int(n) and n >= 0):
        raise RequestError(f"{where}max_new_tokens must be an integer >= 0, got {n!r}")
    # Any top_k >= the vocabulary keeps every token; SGLang's TOP_K_ALL bounds it for the sampler's tensors.
    out.update(temperature=float(t), top_p=float(p), top_k=min(k, TOP_K_ALL), max_new_tokens=n)

    stop = raw.get("stop")
    if isinstance(stop, str):
        stop = [stop]  # SGLang takes one string or a list
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError(f"{where}stop must be a string or a list of strings, got {_short(stop)}")
    if stop is not None and len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"{where}stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are supported")
    if stop is not None and any(len(x) > MAX_STOP_CHARS for x in stop):
        raise RequestError(f"{where}stop strings may be at most {MAX_STOP_CHARS} characters long")
    ids = raw.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(i) for i in ids)):
        raise RequestError(f"{where}stop_token_ids must be a list of integers, got {_short(ids)}")
    seed = raw.get("sampling_seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < MAX_SEED):
        raise RequestError(f"{where}sampling_seed must be an integer in [0, 2**63) or null, got {seed!r}")
    out.update(stop=stop, stop_token_ids=ids, sampling_seed=seed)
    out["no_stop_trim"] = _bool(raw, "no_stop_trim", default.no_stop_trim, where)
    out["skip_special_tokens"] = _bool(raw, "skip_special_tokens", default.skip_special_tokens, where)
    out["ignore_eos"] = _bool(raw, "ignore_eos", default.ignore_eos, where)
    return SamplingParams(**out)


def parse_generate(body: dict[str, Any], *, context: int, text_byte_limit: int) -> GenerateRequest:
    """A ``/generate`` body -> GenerateRequest, or RequestError naming the field (see the module docstring).

    Size checks come before any per-token work: ``input_ids`` must hold fewer than ``context`` ids, and a
    ``text`` longer than ``text_byte_limit`` UTF-8 bytes (more tokens than the context, whatever they are)
    is refused before it is tokenized."""
    if _bool(body, "stream", False):
        raise RequestError("stream: streaming is not supported by rollshard-generate serve")
    input_ids, text = body.get("input_ids"), body.get("text")
    if (input_ids is None) == (text is None):
        raise RequestError("give exactly one of input_ids and text")
    if text is not None:
        if not isinstance(text, str):
            raise RequestError(f"text must be a string, got {type(text).__name__}")
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > text_byte_limit:
            raise RequestError(
                f"text of {size} UTF-8 bytes exceeds the limit of {text_byte_limit} bytes: it is more tokens "
                f"than the model's context of {context}; send a shorter text"
            )
    else:
        if not isinstance(input_ids, list):
            raise RequestError(f"input_ids must be a list of token ids, got {type(input_ids).__name__}")
        if len(input_ids) >= context:
            raise RequestError(
                f"input_ids holds {len(input_ids)} tokens; the model's context of {context} takes at most "
                f"{context - 1} prompt tokens"
            )
        if not all(_is_int(t) for t in input_ids):
            if any(isinstance(t, list) for t in input_ids):
                raise RequestError("input_ids must be one list of token ids; batched requests are not supported")
            bad = next(t for t in input_ids if not _is_int(t))
            raise RequestError(f"input_ids must be a list of integer token ids, found {bad!r}")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestError(f"rid must be a string, got {type(rid).__name__} (batched requests are not supported)")
    lp_start = body.get("logprob_start_len", -1)
    if not _is_int(lp_start):
        raise RequestError(f"logprob_start_len must be an integer, got {lp_start!r}")
    sampling = parse_sampling(body.get("sampling_params"))
    mask = _bool(body, "return_sampling_mask", False)
    mode = body.get("sampling_logprobs_mode")
    if mode is not None and (mode != "selected" or not mask):
        raise RequestError(
            f"sampling_logprobs_mode {mode!r}: only 'selected' is supported, and only with return_sampling_mask"
        )
    if mask:
        _check_sampling_mask(sampling)
    routed = _bool(body, "return_routed_experts", False)
    return GenerateRequest(
        input_ids=input_ids,
        text=text,
        sampling=dataclasses.replace(sampling, return_sampling_mask=mask),
        rid=rid,
        return_logprob=_bool(body, "return_logprob", False),
        return_sampling_mask=mask,
        return_routed_experts=routed,
    )


def _check_sampling_mask(sampling: SamplingParams) -> None:
    """SGLang's condition for return_sampling_mask (scheduler ``handle_generate_request``), its message."""
    top_k = 1 if sampling.temperature < GREEDY_TEMPERATURE_EPS else (TOP_K_ALL if sampling.top_k == -1 else sampling.top_k)
    if not 1 <= top_k <= SAMPLING_MASK_MAX_TOKENS:
        raise RequestError(
            "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= "
            f"{SAMPLING_MASK_MAX_TOKENS}; got top_k={top_k}. Lower top_k"
        )


def parse_abort(body: dict[str, Any]) -> tuple[str | None, bool]:
    """``/abort_request`` body -> (rid, abort_all)."""
    abort_all = _bool(body, "abort_all", False)
    rid = body.get("rid")
    if not abort_all and not isinstance(rid, str):
        raise RequestError(f"rid must be a string (or set abort_all), got {_short(rid)}")
    return rid, abort_all


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."

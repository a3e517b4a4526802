"""The engine interface: prompt token ids in; response ids, one logprob per response token, finish reason out.

Both engines (SGLang over HTTP, the embedded transformers engine) implement
:class:`Engine`. A :class:`GenerateResult` always carries exactly one logprob per
output token; an engine that cannot produce them raises instead of returning a
shortened response (the failure of slime PR #1995 cannot be expressed).

Logprob definition (SGLang's default): log softmax(logits / temperature) at the
sampled token, computed before top-p/top-k truncation; greedy (temperature 0):
log softmax(logits).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from rollshard.store.format.schema import WeightSpan


# SGLang sampling parameters rollshard does not use, at the value that makes them a no-op. The client
# sends them explicitly so a server's defaults (or its --preferred-sampling-params) cannot change the
# sampling distribution, and with it the logprobs, behind the trainer's back; the embedded engine
# accepts them at exactly these values.
NEUTRAL_SAMPLING: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    """SGLang ``sampling_params``; field names and meanings follow SGLang's native API."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_new_tokens: int = 256
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    # SGLang's: no token ends the request (neither an eos nor stop_token_ids); stop strings and max_new_tokens
    # still do. Only the finish check changes: the eos stays in the distribution (SGLang masks no logit for it;
    # only min_new_tokens, sent at 0, would), so the logprobs keep their definition and the trainer's match.
    ignore_eos: bool = False
    # Not a sampling parameter: ask the engine for each output token's sampling support (SGLang's request-level
    # ``return_sampling_mask``); the result then carries sampling_logprobs and sampling_support.
    return_sampling_mask: bool = False
    # Not a sampling parameter either: ask a MoE engine for the routed experts of every position it forwarded
    # (SGLang's request-level ``return_routed_experts``); the result then carries routed_experts (schema 1.2).
    return_routed_experts: bool = False

    def to_json(self) -> dict[str, Any]:
        """The ``sampling_params`` of a request: the set fields, plus :data:`NEUTRAL_SAMPLING` spelled out."""
        # Shallow on purpose: dataclasses.asdict deep-copies, a measurable cost per request at high rates.
        out = {}
        for name in _SAMPLING_FIELDS:
            v = getattr(self, name)
            if v is not None:
                out[name] = list(v) if isinstance(v, list) else v
        out.update(NEUTRAL_SAMPLING)
        return out


_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                         if f.name not in ("return_sampling_mask", "return_routed_experts"))


@dataclasses.dataclass(kw_only=True)
class GenerateResult:
    """One engine response. ``len(logprobs) == len(output_ids)`` always."""

    output_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    finish_detail: dict[str, Any] = dataclasses.field(default_factory=dict)  # matched / length / message, status_code
    weight_version: str | None = None
    weight_versions: list[WeightSpan] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # anything else the engine reported
    # With SamplingParams.return_sampling_mask: per output token, the logprob of the sampled token under the
    # truncated, renormalized distribution, and the ids of that distribution's support (the token among them).
    sampling_logprobs: list[float] | None = None
    sampling_support: list[list[int]] | None = None
    # With SamplingParams.return_routed_experts on a MoE model: ``[positions, layers, top_k]`` expert ids of the
    # positions from ``routed_experts_start`` to the request's last forwarded one (input and output tokens but
    # the last output token: SGLang's ``len(tokens) - 1``); None when the engine forwarded nothing (an abort in
    # the queue) or was not asked.
    routed_experts: Any = None  # numpy integer array
    routed_experts_start: int = 0

    def __post_init__(self) -> None:
        assert len(self.logprobs) == len(self.output_ids), "engine result must have one logprob per output token"
        for name in ("sampling_logprobs", "sampling_support"):
            value = getattr(self, name)
            assert value is None or len(value) == len(self.output_ids), f"engine result must have one {name} per token"


class EngineError(RuntimeError):
    """A request failed for good (after retries, or a 4xx); the message names the request."""


class EngineSettingsError(EngineError):
    """The engine answers, but is set up so that its samples would not be what this run asks for (e.g. a
    server's --preferred-sampling-params); the message says what to change."""


class EngineUnavailableError(EngineError):
    """The engine stopped answering at all (every server refuses connections): a run should stop, not retry
    each remaining prompt. Raised by an engine's circuit breaker; the message says what was seen."""


class Engine(abc.ABC):
    """Async engine: many requests may be in flight at once."""

    @abc.abstractmethod
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None
    ) -> GenerateResult: ...

    @abc.abstractmethod
    async def model_info(self) -> dict[str, Any]:
        """``/get_model_info``-shaped dict (``model_path``, ``weight_version``, ...); raises EngineError if unreachable."""

    # Why a MoE model's routing is not returned, where the engine knows (the embedded engine); else None.
    routing_reason: str | None = None

    async def routed_experts_width(self, sampling: SamplingParams) -> int | None:
        """Expert ids per position (layers x top_k) the engine returns for ``return_routed_experts`` (schema 1.2),
        or None when it returns none; an engine without routing says None."""
        return None

    async def health_check(self, sampling: SamplingParams | None = None) -> list[dict[str, Any]]:
        """One ``model_info`` per server behind the engine; raises EngineError (one line) if one is unreachable."""
        return [await self.model_info()]

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

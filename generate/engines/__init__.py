"""Engines: prompt token ids in, response ids plus one logprob per response token out.

``make_engine(spec)`` builds one from an :class:`~.spec.EngineSpec`, or a string as the command line takes it:

* ``embedded:PATH`` — the transformers engine in process (:mod:`.embedded`), on CPU;
  ``embedded:PATH@cuda`` puts it on the GPU;
* ``URL[,URL...]`` — SGLang servers (or one sglang-router) over HTTP (:mod:`.sglang`).
"""

from __future__ import annotations

from typing import Any

from rollshard.generate.engines.base import Engine, EngineError, GenerateResult, SamplingParams
from rollshard.generate.engines.spec import EngineSpec


def make_engine(spec: str | EngineSpec, **options: Any) -> Engine:
    """Engine from ``spec`` (see module docstring; a string is parsed by :meth:`EngineSpec.parse`); ``options`` go
    to the engine's constructor."""
    if not isinstance(spec, EngineSpec):
        spec = EngineSpec.parse(spec)
    if spec.embedded:
        from rollshard.generate.engines.embedded import EmbeddedEngine

        if spec.device:
            options.setdefault("device", spec.device)
        return EmbeddedEngine(spec.model, **options)
    from rollshard.generate.engines.sglang import SGLangEngine

    return SGLangEngine(list(spec.urls), **options)


__all__ = ["Engine", "EngineError", "EngineSpec", "GenerateResult", "SamplingParams", "make_engine"]

"""Engines: prompt token ids in, response ids plus one logprob per response token out.

``make_engine(spec)`` builds one from a string, as the command line takes it:

* ``embedded:PATH`` — the transformers engine in process (:mod:`.embedded`), on CPU;
  ``embedded:PATH@cuda`` puts it on the GPU;
* ``URL[,URL...]`` — SGLang servers (or one sglang-router) over HTTP (:mod:`.sglang`).
"""

from __future__ import annotations

from typing import Any

from rollshard.generate.engines.base import Engine, EngineError, GenerateResult, SamplingParams


def make_engine(spec: str, **options: Any) -> Engine:
    """Engine from ``spec`` (see module docstring); ``options`` go to the engine's constructor."""
    spec = spec.strip()
    if spec.startswith("embedded:"):
        from rollshard.generate.engines.embedded import EmbeddedEngine

        path, _, device = spec[len("embedded:") :].partition("@")
        if not path:
            raise ValueError("engine spec 'embedded:' needs a model folder, e.g. embedded:models/tiny")
        if device:
            options.setdefault("device", device)
        return EmbeddedEngine(path, **options)
    urls = [u.strip() for u in spec.split(",") if u.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        raise ValueError(
            f"engine spec {spec!r} is neither 'embedded:PATH' nor a comma-separated list of http(s):// URLs"
        )
    from rollshard.generate.engines.sglang import SGLangEngine

    return SGLangEngine(urls, **options)


__all__ = ["Engine", "EngineError", "GenerateResult", "SamplingParams", "make_engine"]

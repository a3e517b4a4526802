"""``--engine SPEC``, parsed once: which engine a run talks to.

* ``embedded:PATH`` -- the transformers engine in process (:mod:`.embedded`), on CPU;
  ``embedded:PATH@DEV`` puts it on device ``DEV`` (``cuda``, ``cuda:1``);
* ``URL[,URL...]`` -- SGLang servers (or one sglang-router) over HTTP (:mod:`.sglang`).

Code that needs to know which kind a run uses asks :attr:`EngineSpec.embedded`; nothing else reads the
spec's text.
"""

from __future__ import annotations

import dataclasses

EMBEDDED_PREFIX = "embedded:"
URL_SCHEMES = ("http://", "https://")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    text: str  # as given on the command line (recorded in the run config, named in messages)
    model: str | None = None  # embedded: the model folder
    device: str | None = None  # embedded: the @DEV of embedded:PATH@DEV
    urls: tuple[str, ...] = ()  # SGLang: the servers' URLs

    @classmethod
    def parse(cls, text: str) -> "EngineSpec":
        """The spec, or ValueError saying what an engine spec looks like."""
        spec = text.strip()
        if spec.startswith(EMBEDDED_PREFIX):
            path, _, device = spec[len(EMBEDDED_PREFIX) :].partition("@")
            if not path:
                raise ValueError("engine spec 'embedded:' needs a model folder, e.g. embedded:models/tiny")
            return cls(text=text, model=path, device=device or None)
        urls = tuple(u.strip() for u in spec.split(",") if u.strip())
        if not urls or not all(u.startswith(URL_SCHEMES) for u in urls):
            raise ValueError(
                f"engine spec {spec!r} is neither 'embedded:PATH' nor a comma-separated list of http(s):// URLs"
            )
        return cls(text=text, urls=urls)

    @property
    def embedded(self) -> bool:
        """The in-process engine (else SGLang servers over HTTP)."""
        return self.model is not None

    def __str__(self) -> str:
        return self.text

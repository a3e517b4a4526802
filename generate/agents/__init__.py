"""Agent systems: how one prompt becomes the rows of one episode.

Built in: ``single`` (n samples, one group per prompt), ``multi_agent`` (solvers ->
rewriters -> selector, slime's examples/multi_agent) and ``tool_loop`` (multi-turn with
calculator observations between turns, masked out of the loss).

``--n-samples`` sets the samples per prompt of ``single`` and ``tool_loop`` and the
number of solvers and of rewriters of ``multi_agent``; any other option is set with
``--agent-option KEY=VALUE`` (the fields of the system's options dataclass).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rollshard.generate.agents.base import AgentCall, AgentSystem, ContextFullError, Episode, derive_seed
from rollshard.generate.agents.multi_agent import MultiAgent, MultiAgentOptions
from rollshard.generate.agents.single import Single, SingleOptions
from rollshard.generate.agents.tool_loop import ToolLoop, ToolLoopOptions

SYSTEMS: dict[str, tuple[type[AgentSystem], type, tuple[str, ...]]] = {
    # name: (system, options dataclass, option fields set by --n-samples)
    "single": (Single, SingleOptions, ("n_samples",)),
    "multi_agent": (MultiAgent, MultiAgentOptions, ("num_solvers", "num_rewriters")),
    "tool_loop": (ToolLoop, ToolLoopOptions, ("n_samples",)),
}


def _convert(value: str, kind: Any, key: str, name: str) -> Any:
    kind = {"int": int, "float": float, "bool": bool, "str": str}.get(kind, kind)
    if kind is bool:
        low = value.lower()
        if low not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"agent option {key}={value!r} of {name}: expected true or false")
        return low in ("1", "true", "yes")
    try:
        return kind(value)
    except ValueError as e:
        raise ValueError(f"agent option {key}={value!r} of {name}: expected {kind.__name__}") from e


def make_agent_system(name: str, *, n_samples: int | None = None, options: dict[str, str] | None = None) -> AgentSystem:
    """Build a system from its name, ``--n-samples`` and ``KEY=VALUE`` options given as strings."""
    try:
        cls, opts_cls, n_fields = SYSTEMS[name]
    except KeyError as e:
        raise ValueError(f"unknown agent system {name!r}; choose one of {', '.join(SYSTEMS)}") from e
    fields = {f.name: f for f in dataclasses.fields(opts_cls)}
    kwargs: dict[str, Any] = {}
    if n_samples is not None:
        kwargs.update({f: n_samples for f in n_fields})
    for key, value in (options or {}).items():
        if key not in fields:
            raise ValueError(f"{name} has no option {key!r}; its options are {', '.join(fields)}")
        kwargs[key] = _convert(value, fields[key].type, key, name) if isinstance(value, str) else value
    return cls(opts_cls(**kwargs))


__all__ = [
    "SYSTEMS",
    "AgentCall",
    "AgentSystem",
    "ContextFullError",
    "Episode",
    "MultiAgent",
    "MultiAgentOptions",
    "Single",
    "SingleOptions",
    "ToolLoop",
    "ToolLoopOptions",
    "derive_seed",
    "make_agent_system",
]

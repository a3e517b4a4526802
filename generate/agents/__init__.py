"""Agent systems: how one prompt becomes the rows of one episode.

Built in: ``single`` (n samples, one group per prompt), ``multi_agent`` (solvers ->
rewriters -> selector, slime's examples/multi_agent) and ``tool_loop`` (multi-turn with
calculator observations between turns, masked out of the loss).

``--n-samples`` sets the samples per prompt of ``single`` and ``tool_loop`` and the
number of solvers and of rewriters of ``multi_agent``; any other option is set with
``--agent-option KEY=VALUE`` (the fields of the system's options dataclass).

A user system (``--agents module:Class`` or ``file.py:Class``) is an :class:`AgentSystem`
subclass written against the same :class:`Episode` API: ``run`` makes calls with
``episode.call``/``episode.extend`` and returns ``episode.row(call)`` rows, ``score`` (optional;
the default scores each row's last turn) sets rewards. If the class has an ``Options``
dataclass, it is built from ``--agent-option`` (and ``--n-samples`` sets its ``n_samples``
field, or the fields named in ``n_samples_fields``) and passed to the constructor; otherwise
the class is built with no argument. An :class:`AgentSystem` instance is used as it is.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from rollshard.generate import plugins
from rollshard.generate.agents.base import (
    AgentCall,
    AgentSystem,
    ContextFullError,
    Episode,
    RowProvenanceError,
    derive_seed,
    play,
    set_reward,
)
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
    """``value`` (text) as the option's type: int, float, bool, str, or an optional one of them (``none``)."""
    kind = {"int": int, "float": float, "bool": bool, "str": str}.get(kind, kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        if type(None) in args and value.strip().lower() in ("none", "null"):
            return None
        kinds = [a for a in args if a is not type(None)]
        kind = kinds[0] if len(kinds) == 1 else str
    if kind not in (int, float, bool, str):
        raise ValueError(f"agent option {key} of {name} has type {kind}; --agent-option sets int, float, bool and str")
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
    """Build a system from its name or plugin spec, ``--n-samples`` and ``KEY=VALUE`` options (strings or values).

    A plugin system's ``plugin`` is its identity (:class:`rollshard.generate.plugins.Plugin`), which its
    :meth:`AgentSystem.config` records, so a resume with an edited plugin file is refused."""
    if plugins.is_spec(name):
        system, plugin = _plugin_system(name, n_samples, options)
        system.plugin = plugin.identity
        return system
    try:
        cls, opts_cls, n_fields = SYSTEMS[name]
    except KeyError as e:
        raise ValueError(
            f"unknown agent system {name!r}; choose one of {', '.join(SYSTEMS)}, or give your own as module:Class "
            "or path/to/file.py:Class"
        ) from e
    return _build(cls, opts_cls, n_fields, name, n_samples, options)


def _plugin_system(spec: str, n_samples: int | None, options: dict[str, str] | None):
    plugin = plugins.load(spec, what="--agents")
    obj = plugin.obj
    if isinstance(obj, AgentSystem):
        own = {k: v for k, v in obj.config().items() if k not in ("name", "plugin")}
        if options and options != own:  # a rescore passes back the recorded options: those are its own
            raise ValueError(f"--agents {spec!r} is a ready system instance; it takes no --agent-option")
        return obj, plugin
    if not (isinstance(obj, type) and issubclass(obj, AgentSystem)):
        raise ValueError(
            f"--agents {spec!r} is a {type(obj).__name__}, not an AgentSystem subclass or instance "
            "(from rollshard.generate.agents import AgentSystem)"
        )
    if not getattr(obj, "name", None):
        obj.name = obj.__name__
    opts_cls = getattr(obj, "Options", None)
    if opts_cls is None:
        if options:
            raise ValueError(f"--agents {spec!r} has no Options dataclass; it takes no --agent-option")
        return _instantiate(spec, obj), plugin
    if not dataclasses.is_dataclass(opts_cls):
        raise ValueError(f"--agents {spec!r}: {obj.__name__}.Options must be a dataclass")
    names = {f.name for f in dataclasses.fields(opts_cls)}
    n_fields = tuple(getattr(obj, "n_samples_fields", ("n_samples",) if "n_samples" in names else ()))
    return _build(obj, opts_cls, n_fields, spec, n_samples, options), plugin


def _instantiate(spec: str, cls, *args):
    try:
        return cls(*args)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--agents {spec!r}: building {cls.__name__} failed: {e}") from e


def _build(cls, opts_cls, n_fields, name, n_samples, options) -> AgentSystem:
    fields = {f.name: f for f in dataclasses.fields(opts_cls)}
    try:
        hints = typing.get_type_hints(opts_cls)
    except Exception:  # an annotation that does not resolve: take the field's own
        hints = {n: f.type for n, f in fields.items()}
    kwargs: dict[str, Any] = {}
    if n_samples is not None:
        kwargs.update({f: n_samples for f in n_fields})
    for key, value in (options or {}).items():
        if key not in fields:
            raise ValueError(f"{name} has no option {key!r}; its options are {', '.join(fields)}")
        kwargs[key] = _convert(value, hints.get(key, fields[key].type), key, name) if isinstance(value, str) else value
    return _instantiate(name, cls, opts_cls(**kwargs))


__all__ = [
    "SYSTEMS",
    "AgentCall",
    "AgentSystem",
    "ContextFullError",
    "Episode",
    "MultiAgent",
    "RowProvenanceError",
    "MultiAgentOptions",
    "Single",
    "SingleOptions",
    "ToolLoop",
    "ToolLoopOptions",
    "derive_seed",
    "make_agent_system",
    "play",
    "set_reward",
]

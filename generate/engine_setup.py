"""Reaching the engine a run uses, and reading what it serves: the connection, the weights it loads
(``--update-weights``), its model info and version, the tokenizer, the context, the admission gate and the routing
shape the rows store. Each step's failure is one UsageError the user can act on; nothing is written before them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from rollshard.generate.admission import AdmissionGate, integer_version
from rollshard.generate.arguments import PROG
from rollshard.generate.engines.base import Engine, EngineError, EngineSettingsError, SamplingParams
from rollshard.generate.engines.spec import EngineSpec
from rollshard.store.common import UsageError
from rollshard.store.format.routing import RoutingShape, RoutingShapeError, shape_of_model_folder
from rollshard.store.models.tokenizer import TokenizerError, load_tokenizer
from rollshard.store.models.versions import resolve_model_path

if TYPE_CHECKING:
    from rollshard.generate.config import GenerateConfig

CONTEXT_KEYS = ("max_context_length", "context_length", "max_context_len")  # model_info names for the context
MAX_SANE_CONTEXT = 1 << 24  # tokenizers without a limit report ~1e30 as model_max_length


def quiet_model_loading() -> None:
    """transformers' own bars (loading weights) would interleave with the run's progress bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def connect(config: GenerateConfig) -> Engine:
    """The engine of ``--engine``, with the options of its kind."""
    from rollshard.generate import engines

    options: dict[str, Any] = {}
    if config.engine.embedded:
        options["weight_version"] = config.weight_version  # None: the checkpoint folder's own, else "0"
        options["dtype"] = config.dtype
        options["threads"] = config.threads
        if config.device is not None:
            options["device"] = config.device
    else:
        from rollshard.generate.engines.sglang import SGLangConfig

        # The runner bounds requests in flight; the client must not bound them lower.
        options["config"] = SGLangConfig(max_concurrency=config.concurrency, request_timeout_s=config.request_timeout)
    try:
        return engines.make_engine(config.engine, **options)
    except (EngineError, ValueError, OSError) as e:
        raise UsageError(f"cannot start engine {config.engine.text!r}: {e}") from e


async def update_weights(engine: Engine, checkpoint: str, version: str | None) -> None:
    """``--update-weights``: every server loads the checkpoint (as its own version unless --weight-version)."""
    path = resolve_model_path(checkpoint)
    try:
        await engine.update_weights_from_disk(path, version)
    except (EngineError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        raise UsageError(f"--update-weights {checkpoint}: the servers did not load it: {e}") from e


async def model_info(engine: Engine, spec: EngineSpec, sampling: SamplingParams, version: str | None) -> dict[str, Any]:
    """The engine's model info, after checking every server answers, samples as asked and serves ``version``
    when one is asked for (one line if not)."""
    try:
        infos = await engine.health_check(sampling)
    except EngineSettingsError as e:
        raise UsageError(f"engine {spec.text!r} cannot be used as it is: {e}") from e
    except (EngineError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        raise UsageError(f"cannot reach engine {spec.text!r}: {e}") from e
    # A server stamps every response with the version it serves; rows must carry the version that generated
    # them, so --weight-version cannot relabel a server's output: it checks it.
    served = sorted({str(info.get("weight_version")) for info in infos})
    if version is not None and served != [version]:
        raise UsageError(
            f"engine {spec.text!r} serves weight_version {', '.join(served)}, not --weight-version {version}; load "
            "that checkpoint with /update_weights_from_disk (or /update_weight_version) first, or drop "
            "--weight-version"
        )
    return infos[0]


def admission_gate(config: GenerateConfig, info: dict[str, Any]) -> AdmissionGate | None:
    """``--max-ahead``'s gate, once the engine serves a version it can count (one line if not)."""
    if config.max_ahead is None:
        return None
    try:
        integer_version(info.get("weight_version"))
    except ValueError as e:
        raise UsageError(f"{e}; serve a rollshard checkpoint (versions 0, 1, 2, ...) or drop --max-ahead") from e
    return AdmissionGate(
        max_ahead=config.max_ahead, step_episodes=config.step_episodes, first_version=config.first_version
    )


def tokenizer_path(config: GenerateConfig, info: dict[str, Any]) -> str:
    """``--tokenizer``, else the folder the engine reports."""
    path = config.tokenizer or info.get("tokenizer_path") or info.get("model_path")
    if not path:
        raise UsageError(
            f"engine {config.engine.text!r} reports no model path to load the tokenizer from; pass --tokenizer"
        )
    return path


def tokenizer_of(path: str, sampling: SamplingParams):
    """The run's tokenizer; refused when the sampling support was asked with a top-k over the whole vocabulary."""
    try:
        tokenizer = load_tokenizer(path)
    except TokenizerError as e:
        raise UsageError(f"{e} (or pass --tokenizer)") from e
    if sampling.return_sampling_mask and sampling.top_p >= 1.0 and sampling.top_k >= len(tokenizer):
        raise UsageError(
            f"--top-k {sampling.top_k} is at least the vocabulary ({len(tokenizer)} tokens): nothing truncates, and "
            "the support of every token would be the whole vocabulary; lower --top-k or pass --sampling-support off"
        )
    return tokenizer


def context_len(config: GenerateConfig, info: dict[str, Any], tokenizer) -> int | None:
    """``--max-context-len``, else the engine's, else the tokenizer's (None: no limit known)."""
    if config.max_context_len is not None:
        return config.max_context_len
    for key in CONTEXT_KEYS:
        if info.get(key):
            return int(info[key])
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < MAX_SANE_CONTEXT else None


async def resolve_routing(
    mode: str, spec: EngineSpec, engine: Engine, folders: list[str | None], sampling: SamplingParams
) -> RoutingShape | None:
    """The routing shape the run stores (``--routed-experts`` ``mode``), or None: the model's (the config.json of
    the engine's model folder, else of the tokenizer's), when it is a mixture of experts and the engine returns
    routing of that shape."""
    if mode == "off":
        return None
    try:
        shape = served_model_routing(folders)
    except RoutingShapeError as e:
        if mode == "on":
            raise UsageError(f"--routed-experts on: {e}") from e
        print(f"{PROG}: note: {e}; rows are written without routed experts", file=sys.stderr)
        return None
    if shape is None:
        if mode == "on":
            raise UsageError(f"--routed-experts on: the model ({folders[0]}) is not a mixture of experts whose "
                             "config.json names num_experts and num_experts_per_tok; use --routed-experts auto")
        return None
    try:
        width = await engine.routed_experts_width(sampling)
    except EngineError as e:
        raise UsageError(str(e)) from e
    if width is None:
        why = engine.routing_reason or (
            f"engine {spec.text!r} returns no routed experts (start the SGLang server with "
            "--enable-return-routed-experts)")
        if mode == "on":
            raise UsageError(f"--routed-experts on: {why}; or use --routed-experts auto/off")
        print(f"{PROG}: note: {why}; rows are written without routed experts", file=sys.stderr)
        return None
    if width != shape.width:
        raise UsageError(
            f"the engine returns {width} expert ids per position, but {folders} describes {shape.layers} layers x "
            f"top-{shape.top_k} = {shape.width}: the local config.json is of another model; pass --tokenizer with "
            "the served model's folder, or --routed-experts off"
        )
    return shape


def served_model_routing(folders: list[str | None]) -> RoutingShape | None:
    """The routing shape of the served model, from the first of ``folders`` with a config.json (None: dense)."""
    for folder in folders:
        if folder and (Path(str(folder)) / "config.json").is_file():
            return shape_of_model_folder(folder)
    raise RoutingShapeError(
        f"no config.json in the engine's model folder {folders[0]!r} (nor in the tokenizer's) to tell whether the "
        "model is a mixture of experts; pass --tokenizer with the model's local folder"
    )

"""The run config: the record every shard of the run carries in its metadata (and a resume compares,
:data:`rollshard.generate.resume.GENERATION_KEYS`), built here from the :class:`GenerateConfig` and nowhere else.

:func:`run_config` holds what is known before the engine starts; :func:`served_fields` what the engine answers
(model, tokenizer, weight version, context), added to it once the engine is up.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata
from typing import TYPE_CHECKING, Any

from rollshard.generate.arguments import PROG
from rollshard.generate.chat import ChatFormat
from rollshard.generate.engines.base import SamplingParams
from rollshard.generate.inputs import Inputs
from rollshard.store.models.fingerprint import model_fingerprint
from rollshard.store.models.gguf import gguf_source
from rollshard.store.models.versions import resolve_model_path

if TYPE_CHECKING:
    from rollshard.generate.config import GenerateConfig


def run_config(config: GenerateConfig, inputs: Inputs, sampling: SamplingParams) -> dict[str, Any]:
    """The run config before the engine answers (:func:`served_fields` adds its part)."""
    try:
        version = metadata.version("rollshard")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "command": PROG,
        "rollshard_version": version,
        "engine": config.engine.text,
        **({"engine_dtype": config.dtype} if config.engine.embedded else {}),
        "agents": inputs.system.config(),
        "task": inputs.task.name,
        "task_plugin": inputs.task.plugin,
        "reward": inputs.scorer.identity,
        "system_prompt": inputs.task.system_prompt,
        "prompts": inputs.source,
        "prompts_fingerprint": inputs.fingerprint,
        "input_key": config.input_key,
        "label_key": config.label_key,
        "id_key": config.id_key,
        "limit": config.limit,
        "split": config.split,
        "task_options": inputs.task_options,
        # return_sampling_mask is recorded as sampling_support: a config without it (before schema 1.1) means off.
        "sampling": sampling_config(sampling),
        "sampling_support": "on" if sampling.return_sampling_mask else "off",
        "sampling_support_mode": config.sampling_support,  # as given (auto resolves to the value above)
        "seed": config.seed,
        "n_samples": config.n_samples,
        "shard_index": config.shard_index,
        "num_shards": config.num_shards,
        "concurrency": config.concurrency,
        "allow_skipped_calls": config.allow_skipped_calls,
    }


def served_fields(
    info: dict[str, Any], *, tokenizer_path: str, tokenizer, context_len: int | None, chat: ChatFormat
) -> dict[str, Any]:
    """The run config's fields from what the engine serves (``info``, its model info) and the tokenizer."""
    model = resolve_model_path(info["model_path"]) if info.get("model_path") else None
    fields: dict[str, Any] = {
        # Absolute, links resolved (checkpoints/latest -> step_N): the dataset names the exact policy, and
        # inspect / the notebook find the tokenizer from anywhere.
        "model": model,
        # The weights themselves (rollshard-train compares its --model's); None where the folder is not local.
        "model_fingerprint": model_fingerprint(model) if model else None,
        "tokenizer": resolve_model_path(tokenizer_path),
        "weight_version": info.get("weight_version"),
        "max_context_len": context_len,
        "chat_template": chat.config(tokenizer),
    }
    if model and (source := gguf_source(model)):
        fields["model_source"] = source  # a .gguf file's name and sha256 (its converted folder is a cache)
    return fields


def sampling_config(sampling: SamplingParams) -> dict[str, Any]:
    """The run config's ``sampling``: every field but the per-request seed and the support (recorded apart).
    ``ignore_eos`` only when set: configs written before it existed mean false, and the resume check compares
    the dicts key by key, so a false written out would refuse to resume every earlier dataset."""
    out = {k: v for k, v in dataclasses.asdict(sampling).items()
           if k not in ("sampling_seed", "return_sampling_mask", "return_routed_experts")}
    if not out["ignore_eos"]:
        del out["ignore_eos"]
    return out

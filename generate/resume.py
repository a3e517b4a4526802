"""Resuming into ``--out``: what the folder holds, read once before the run, and the checks that refuse to add this
run's rows to a dataset made otherwise.

* the folder: a rollshard dataset or nothing (other files refused), a generation run (not a derived dataset);
* the settings: every key of :data:`GENERATION_KEYS` equal to what the dataset's writers recorded (the first
  differing one is named; keys added after a dataset was written compare as their :data:`GENERATION_KEY_DEFAULTS`);
* the prompts: every prompt already in the dataset hashes (rendered ids and label) as the source's does now, so an
  edited or swapped prompt file is refused rather than skipped as done.

Which prompts are done, and the ledger of those that failed, are the runner's (:mod:`.runner`, :mod:`.ledger`).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from rollshard.generate.tasks import Prompt
from rollshard.generate.tasks.schedule import source_prompt_id
from rollshard.store.common import UsageError
from rollshard.store.format.lineage import lineage_of
from rollshard.store.format.schema import SchemaVersionError
from rollshard.store.io.dataset import DatasetNotFoundError, RolloutDataset, check_dataset_out

# Settings that change what a prompt's rows are; resuming into a dataset made with others would mix runs. A plugin's
# identity (file and hash) is part of "agents", "task_plugin" and "reward". (The chat template and system prompt
# change the rendered prompt, which the per-prompt hash check catches.)
GENERATION_KEYS = (
    "agents", "task", "task_plugin", "reward", "sampling", "seed", "input_key", "label_key", "id_key",
    "allow_skipped_calls", "sampling_support", "engine_dtype",
)
# The value of a key in a config written before the key existed ("reward": the task's verifier, see _default).
GENERATION_KEY_DEFAULTS = {"allow_skipped_calls": False, "task_plugin": None, "sampling_support": "off",
                           "engine_dtype": "float32"}
# Where a plugin's file lies differs between hosts and checkouts: in a plugin identity ({spec, file, sha256}) the
# spec and sha256 identify it, the file is not compared.
IDENTITY_PATH_KEY = "file"


class ConfigMismatchError(ValueError):
    """The dataset was generated with other settings than this run's."""


class ExistingDataset:
    """What ``--out`` holds before the run: a dataset, nothing, or something that cannot be resumed (the error is
    kept and raised by :meth:`check_run_config`, in its turn among the run's checks)."""

    def __init__(self, out: str, dataset: RolloutDataset | None, error: Exception | None = None):
        self.out, self.dataset, self.error = out, dataset, error

    @classmethod
    def open(cls, out: str) -> "ExistingDataset":
        try:
            return cls(out, RolloutDataset.open(out))
        except DatasetNotFoundError:
            return cls(out, None)
        except (SchemaVersionError, ValueError, OSError) as e:
            return cls(out, None, e)

    def holds_rows_without_supports(self) -> bool:
        """Rows generated before the sampling support was recorded (no such config key): ``--sampling-support
        auto`` resumes them as they were made."""
        if self.dataset is None:
            return False
        return any(m.shards and "agents" in (m.config or {}) and "sampling_support" not in m.config
                   for m in self.dataset.manifests)

    def check_run_config(self, config: dict[str, Any]) -> None:
        """UsageError unless this run may write into ``--out``: a new or empty folder, or a generation run's dataset
        made with the same settings (:func:`check_resume_config`)."""
        out = self.out
        check_dataset_out(out, fix="give a new or empty folder, or a dataset to resume")
        if self.error is not None:
            raise UsageError(f"cannot resume into {out}: {self.error}") from self.error
        if self.dataset is None:
            return
        lineage = lineage_of(self.dataset)
        if lineage:
            raise UsageError(
                f"{out} is a derived dataset ({lineage[0].get('operation')} of {lineage[0].get('parent')}), not a "
                "generation run; generate into a new --out (or into its parent)"
            )
        try:
            check_resume_config(self.dataset, config)
        except ConfigMismatchError as e:
            raise UsageError(str(e)) from e

    def check_prompts(self, prompts: list[Prompt], hash_of: Callable[[Prompt], str], *, passes: bool) -> None:
        """UsageError when a prompt changed under its id, in any pass of --repeat (:func:`check_resume_prompts`)."""
        if self.dataset is None:
            return
        try:
            check_resume_prompts(self.dataset, prompts, hash_of, passes=passes)
        except ConfigMismatchError as e:
            raise UsageError(str(e)) from e


def check_resume_config(dataset: RolloutDataset, config: dict[str, Any]) -> None:
    """Refuse to add rows made with other generation settings to an existing dataset, naming the setting."""
    for manifest in dataset.manifests:
        old = manifest.config or {}
        if not manifest.shards or "agents" not in old:
            continue
        for key in GENERATION_KEYS:
            default = _default(key, old)
            diff = _first_difference(old.get(key, default), config.get(key, default), key)
            if diff is not None:
                name, there, now = diff
                raise ConfigMismatchError(
                    f"{dataset.storage.uri} holds rows generated with another {name} ({_show(there)} there, "
                    f"{_show(now)} now; writer {manifest.writer_id}); resume with the original settings or write "
                    "to a new --out"
                )


def _default(key: str, old: dict[str, Any]) -> Any:
    """What a config written before ``key`` was recorded meant by it."""
    if key == "reward":  # every such dataset was scored by its task's verifier
        return {"kind": "task", "task": old.get("task")}
    return GENERATION_KEY_DEFAULTS.get(key)


def _first_difference(old: Any, new: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first (dotted key, old value, new value) where two JSON-like values differ; None if equal. The file of a
    plugin identity (a dict with a ``sha256``) is not compared (:data:`IDENTITY_PATH_KEY`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = set(old) | set(new)
        if "sha256" in old and "sha256" in new:
            keys.discard(IDENTITY_PATH_KEY)
        for key in sorted(keys, key=str):
            diff = _first_difference(old.get(key), new.get(key), f"{path}.{key}")
            if diff is not None:
                return diff
        return None
    return None if old == new else (path, old, new)


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def check_resume_prompts(dataset: RolloutDataset, prompts: list[Prompt], hash_of, *, passes: bool = False) -> None:
    """Refuse to resume when a prompt already in the dataset is not the same prompt any more.

    Each row keeps ``metadata.prompt_hash`` (the rendered prompt ids and label, see
    :func:`rollshard.generate.agents.base.prompt_hash`); ``hash_of(prompt)`` computes the
    current one. A prompt source edited, reordered or swapped under position ids would
    otherwise be skipped as done while the dataset holds the old prompts. Prompts not yet
    in the dataset may be added freely. Rows written before hashes were kept are not checked.
    ``passes`` (``--repeat``): the rows of every pass of a prompt (``ID~k``, :func:`repeat_prompts`) are its too.
    """
    stored = _stored_prompt_hashes(dataset)
    if not stored:
        return
    ids_of: dict[str, list[str]] = {}  # source prompt id -> its ids in the dataset
    for prompt_id in stored:
        ids_of.setdefault(source_prompt_id(prompt_id) if passes else prompt_id, []).append(prompt_id)
    for prompt in prompts:
        ids = ids_of.get(prompt.prompt_id)
        if not ids:
            continue
        now = hash_of(prompt)
        for prompt_id in ids:
            there = stored[prompt_id]
            if now != there:
                raise ConfigMismatchError(
                    f"prompt {prompt_id!r} (position {prompt.index} of the source) is not the prompt "
                    f"{dataset.storage.uri} holds under that id: its text, label or rendering changed (prompt hash "
                    f"{there} there, {now} now); resume with the original prompt source or write to a new --out"
                )


def _stored_prompt_hashes(dataset: RolloutDataset) -> dict[str, str]:
    """``prompt_id -> metadata.prompt_hash`` of the dataset's rows (one per prompt; none for older rows)."""
    import polars as pl

    if not dataset.shards:
        return {}
    frame = (
        dataset.scan()
        .select("prompt_id", pl.col("metadata").str.json_path_match("$.prompt_hash").alias("hash"))
        .drop_nulls("hash")
        .unique("prompt_id", keep="first")
        .collect()
    )
    return dict(zip(frame["prompt_id"].to_list(), frame["hash"].to_list()))

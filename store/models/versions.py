"""Policy versions of model folders, shared by the engines (which version they generate as) and the trainer
(which version it starts from), so a checkpoint's rows, its engine and the next training run agree.

A rollshard checkpoint (``OUT/checkpoints/step_N``) records its ``weight_version`` in
``trainer_state.json``; any other model folder (a base model, an export) has none, and
callers fall back to their own default (``"0"``) or an explicit ``--weight-version``.
Links (``checkpoints/latest``) are resolved, so what is recorded names the real folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rollshard.store.models.gguf import gguf_folder, is_gguf

STATE_FILE = "trainer_state.json"  # written by rollshard.train.checkpoint


class VersionError(ValueError):
    """A checkpoint's state file is unreadable."""


def resolve_model_path(path: str | os.PathLike) -> str:
    """Absolute path with links resolved (``latest`` -> ``step_00000012``); a ``.gguf`` file is its converted fp32
    folder (:func:`rollshard.store.models.gguf.gguf_folder`, converted once); a non-local name is kept as given."""
    p = Path(path).expanduser()
    if p.is_file() and is_gguf(p):
        return str(gguf_folder(p).resolve())
    return str(p.resolve()) if p.exists() else str(path)


def folder_weight_version(path: str | os.PathLike) -> str | None:
    """The ``weight_version`` of a rollshard checkpoint folder; None for a folder that is not one."""
    state = Path(path).expanduser() / STATE_FILE
    if not state.is_file():
        return None
    try:
        doc = json.loads(state.read_text())
    except (OSError, ValueError) as e:
        raise VersionError(f"{state}: unreadable checkpoint state ({e}); is the checkpoint complete?") from e
    if not isinstance(doc, dict):
        raise VersionError(f"{state}: not a checkpoint state (a JSON object); is the checkpoint complete?")
    version = doc.get("weight_version")
    return None if version is None else str(version)

"""Checkpoints: a Hugging Face model folder plus everything a resumed run needs.

Layout of ``OUT/checkpoints/step_00000012/``:

* ``config.json``, ``model.safetensors``, tokenizer files, ``generation_config.json``:
  a model folder that transformers, the embedded engine and SGLang
  (``/update_weights_from_disk``) load as it is. Weights are the fp32 master weights.
* ``optimizer/state.safetensors`` + ``optimizer/meta.json``: AdamW moments (tensors,
  keyed ``<param>::<state>``) and the non-tensor state and parameter groups. No
  pickle. In a subfolder because engines load every ``*.safetensors`` file at the
  top of a model folder as weights (SGLang's ``/update_weights_from_disk`` does).
* ``trainer_state.json``: step, optimizer updates, weight version, world size and
  every rank's loader state (``RolloutLoader.state_dict()``, or ``MixtureLoader.state_dict()``
  for ``--data a:0.7,b:0.3``: one cursor per source; rollshard.store.mixture).
* ``train_config.yaml``: the resolved :class:`~rollshard.train.config.TrainConfig`.

A checkpoint is written under ``.tmp-step_...``, every file and folder of it is
fsynced, and it is renamed when complete (the parent folder fsynced after, as
``rollshard.store.storage`` does, so the rename survives a power cut); then
``OUT/checkpoints/latest``, a relative symlink to it, is replaced by
create-then-rename, so ``--model OUT/checkpoints/latest`` (or an engine's
``model_path``) always names a complete checkpoint. A crash while saving leaves the
previous checkpoint as the latest one. Saving a step that already exists (a resumed
run repeating it) renames the old folder aside to ``.old-step_...``, renames the new
one in and deletes the old one last: ``latest`` names a complete folder except for
the instant between those two renames, never for the length of a delete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

CKPT_DIR = "checkpoints"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "train_config.yaml"
OPTIM_DIR = "optimizer"
OPTIM_TENSORS = "state.safetensors"
OPTIM_META = "meta.json"
STATE_VERSION = 1
OLD_PREFIX = ".old-"  # a checkpoint folder being replaced by a new save of the same step


@dataclasses.dataclass(kw_only=True)
class Checkpoint:
    """A saved checkpoint on disk."""

    path: Path
    step: int
    updates: int
    weight_version: str
    world_size: int
    loader_states: list[dict[str, Any]]

    def optimizer_state(self) -> dict[str, Any]:
        return load_optimizer_state(self.path)


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def save_optimizer_state(state: dict[str, Any], folder: Path) -> None:
    """``torch.distributed.checkpoint`` full optimizer state -> safetensors + JSON under ``folder/optimizer``."""
    folder = folder / OPTIM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param}::{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(param, {})[key] = value
    save_file(tensors, str(folder / OPTIM_TENSORS))
    meta = {"param_groups": state["param_groups"], "scalars": scalars}
    (folder / OPTIM_META).write_text(json.dumps(meta, default=list, indent=1))


def load_optimizer_state(folder: Path) -> dict[str, Any]:
    folder = folder / OPTIM_DIR
    tensors = load_file(str(folder / OPTIM_TENSORS))
    meta = json.loads((folder / OPTIM_META).read_text())
    state: dict[str, dict[str, Any]] = {}
    for name, value in tensors.items():
        param, key = name.rsplit("::", 1)
        state.setdefault(param, {})[key] = value
    for param, entries in meta["scalars"].items():
        state.setdefault(param, {}).update(entries)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def save_checkpoint(
    out: Path,
    *,
    step: int,
    backend: Any,
    loader_states: list[dict[str, Any]],
    weight_version: str,
    world_size: int,
    config_yaml: str,
    is_main: bool,
    keep_last: int,
) -> Path:
    """Write ``OUT/checkpoints/step_N`` (collective: every rank calls it; rank 0 writes)."""
    model_state = backend.model_state()
    optim_state = backend.optimizer_state()
    root = Path(out) / CKPT_DIR
    final = root / checkpoint_name(step)
    if not is_main:
        return final
    root.mkdir(parents=True, exist_ok=True)
    _recover_aside(root)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    aside = root / f"{OLD_PREFIX}{checkpoint_name(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)
    backend.save_model(tmp, model_state)
    save_optimizer_state(optim_state, tmp)
    state = {
        "version": STATE_VERSION,
        "step": step,
        "updates": backend.updates,
        "weight_version": weight_version,
        "world_size": world_size,
        "loader_states": loader_states,
    }
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    (tmp / CONFIG_FILE).write_text(config_yaml)
    _fsync_tree(tmp)
    replaced = final.exists()
    if replaced:
        os.replace(final, aside)  # kept whole until the new folder is in place
    os.replace(tmp, final)
    _fsync_dir(root)
    _link_atomic(root / LATEST, final.name)
    if replaced:
        shutil.rmtree(aside)
    _prune(root, keep_last)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """fsync every file, then every folder (deepest first), so a rename of ``folder`` publishes durable data."""
    for dirpath, _, filenames in os.walk(folder, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _recover_aside(root: Path) -> None:
    """Finish a re-save that a crash interrupted: an ``.old-step_N`` is garbage once ``step_N`` exists, and
    the only copy of the step (moved back) when it does not."""
    for old in root.glob(f"{OLD_PREFIX}step_*"):
        final = root / old.name[len(OLD_PREFIX):]
        if final.exists():
            shutil.rmtree(old)
        else:
            os.replace(old, final)
            _fsync_dir(root)


def _link_atomic(link: Path, target: str) -> None:
    tmp = link.with_name(link.name + ".tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)
    _fsync_dir(link.parent)


def _prune(root: Path, keep_last: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[: max(len(done) - max(keep_last, 1), 0)]:
        shutil.rmtree(old)


def latest_checkpoint(out: str | Path) -> Checkpoint | None:
    """The checkpoint ``OUT/checkpoints/latest`` links to, or None when there is none."""
    link = Path(out) / CKPT_DIR / LATEST
    if not link.is_symlink():
        return None
    return read_checkpoint(link.resolve())


def read_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable rollshard-train checkpoint ({e}); delete it or point elsewhere") from e
    if state.get("version", 0) > STATE_VERSION:
        raise ValueError(f"{path}: checkpoint format {state['version']} is newer than this rollshard reads")
    return Checkpoint(
        path=path,
        step=int(state["step"]),
        updates=int(state["updates"]),
        weight_version=str(state["weight_version"]),
        world_size=int(state["world_size"]),
        loader_states=list(state["loader_states"]),
    )

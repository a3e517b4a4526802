"""Checkpoints: a Hugging Face model folder plus everything a resumed run needs.

Layout of ``OUT/checkpoints/step_00000012/`` (format 3):

* ``config.json``, ``model.safetensors``, tokenizer files, ``generation_config.json``:
  a model folder that transformers, the embedded engine and SGLang
  (``/update_weights_from_disk``) load as it is. Weights are the fp32 master weights, gathered
  one tensor at a time and written by rank 0 (``export_model``; peak: the largest tensor). A resume builds
  its model from this folder, as from ``--model``, so these are also the weights it continues from.
* ``shards/``: the sharded AdamW state, safetensors files of each rank in the layout
  of torch.distributed.checkpoint's safetensors storage, which reads them (each rank streams its
  own files out; rollshard.train.sharded: the layout, and why not DCP's default pickled metadata). Each rank writes and reads only its
  own shards, any world size loading what any wrote. In a subfolder because engines load every ``*.safetensors``
  file at the top of a model folder as weights (SGLang's ``/update_weights_from_disk`` does).
* ``trainer_state.json``: format version, step, optimizer updates, weight version, world size and
  every rank's loader state (``RolloutLoader.state_dict()``, or ``MixtureLoader.state_dict()``
  for ``--data a:0.7,b:0.3``: one cursor per source; rollshard.store.loader.mixture).
* ``train_config.yaml``: the resolved :class:`~rollshard.train.config.TrainConfig`.

A run's last checkpoint may hold its model only (``--final-checkpoint model``; ``"optimizer": false`` in its
``trainer_state.json``, no ``shards/``): the model folder, its version and the data cursors, for a run nothing
continues (each ``rollshard-loop`` round starts from a fresh optimizer). That is a third of an AdamW checkpoint's
bytes (torchtitan's ``last_save_model_only``). A resume of it may finish the run (nothing left to train) but not
train a step: the optimizer state to continue from was not kept (:meth:`Trainer.run` refuses in one line).

Format 2 kept the weights under ``shards/`` as well (``model/<name>``, sharded like the moments), a second copy of
what the model folder holds: a quarter of a checkpoint of AdamW's fp32 state. It is what a backend writes whose
export is not its weights as held (:attr:`~rollshard.train.backends.base.Backend.exports_held_weights`: megatron's,
an HF model whose class converts weights on load), and it resumes as before: the model built from the run's
``--model``, every weight and moment then loaded from the shards.

Format 1 (rollshard before sharded checkpoints) kept the whole optimizer state in
``optimizer/state.safetensors`` + ``optimizer/meta.json``, gathered to rank 0; it still resumes
(weights from its model folder, the optimizer state loaded whole on every rank), and the next save
writes format 3. One written under torchrun resumes at world size 1 only: its loader states are of loader
state version 1 (every rank read the whole stream), which the loader's state check refuses above one rank
(rollshard.store.loader), so a run of more processes has to start its data anew.

A checkpoint is written under ``.tmp-step_...``: rank 0 clears every leftover ``.tmp-step_*`` (a save
of this step or another that a crash tore), every rank writes its shards into it, rank 0 the model folder
and the state files; after a barrier (every rank's files written and fsynced) rank 0 checks that every
rank's shard files are there (refusing to publish, on every rank, where one is missing: ``--out`` is not
shared), fsyncs every file and folder of it and renames it when complete (the parent folder fsynced
after, as ``rollshard.store.io.storage`` does, so the rename survives a power cut); then
``OUT/checkpoints/latest``, a relative symlink to it, is replaced by create-then-rename, so
``--model OUT/checkpoints/latest`` (or an engine's ``model_path``) always names a complete checkpoint.
A crash while saving, on any rank, leaves the previous checkpoint as the latest one. Saving a step that already exists (a resumed run repeating it) renames the old
folder aside to ``.old-step_...``, renames the new one in and deletes the old one last: ``latest``
names a complete folder except for the instant between those two renames, never for the length of
a delete; a crash in that instant is recovered (the old folder moved back) before a resume reads
``latest`` (:func:`recover`), and by the next save. Every rank writes into the folder, so under torchrun
``--out`` must be on a file system all ranks see.

Pruning keeps the ``--keep-last`` newest checkpoints up to the one just published, which it never deletes.
A checkpoint of a later step than that one is an abandoned future, deleted first: a crash after its rename
but before the ``latest`` link left it, and this run, resumed from an earlier one, trains those steps again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollshard.store.common import fsync_dir, write_atomic

if TYPE_CHECKING:
    from rollshard.train.backends.distributed import DistEnv

# Nothing here imports torch at import time: the loops read checkpoints (latest_checkpoint) without it.
SHARDS_DIR = "shards"  # a format-2 checkpoint's folder of per-rank state (rollshard.train.sharded writes it)

CKPT_DIR = "checkpoints"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "train_config.yaml"
# 3: the weights in the model folder only, the optimizer state under shards/; 2: the weights under shards/ too (a
# backend whose export is not its weights as held, and every checkpoint written before 3); 1: optimizer/ gathered
STATE_VERSION = 3
WEIGHTS_IN_SHARDS = 2  # the format written when the model folder's weights are not the held ones
V1_OPTIM_DIR, V1_OPTIM_TENSORS, V1_OPTIM_META = "optimizer", "state.safetensors", "meta.json"
OLD_PREFIX = ".old-"  # a checkpoint folder being replaced by a new save of the same step


@dataclasses.dataclass(kw_only=True)
class Checkpoint:
    """A saved checkpoint on disk."""

    path: Path
    version: int
    step: int
    updates: int
    weight_version: str
    world_size: int
    loader_states: list[dict[str, Any]]
    optimizer: bool = True  # False: the model only (--final-checkpoint model), nothing under shards/

    @property
    def weights_from(self) -> Path | None:
        """The model folder a resumed backend is built from: this checkpoint's own for formats 1 and 3; None (the
        run's ``--model``) for format 2, whose shards then replace every weight."""
        return None if self.version == WEIGHTS_IN_SHARDS and self.optimizer else self.path

    def restore(self, backend: Any) -> None:
        """Optimizer state, update count and (format 2) weights into a backend built from :attr:`weights_from`
        (collective under torchrun); of a model-only checkpoint, the update count alone."""
        if not self.optimizer:  # the backend's weights are its folder's, and there is nothing else to load
            backend.updates = self.updates
            return
        if self.version < 2:
            backend.load_optimizer_state(load_v1_optimizer_state(self.path))
        else:
            backend.load_state(self.path / SHARDS_DIR, weights=self.version == WEIGHTS_IN_SHARDS)
        backend.updates = self.updates


# The config.json fields that fix a model's parameter names and shapes (Llama/Qwen-style and GPT-2-style names).
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "n_embd", "n_layer", "n_head", "n_inner")


def architecture_mismatch(checkpoint: Path, model: Path) -> str | None:
    """What differs between the architecture of a checkpoint's model folder and a model folder's (their configs as
    transformers reads them, defaults filled in: a saved ``config.json`` leaves out what equals the class's default):
    the first three fields that do, e.g. ``hidden_size 64 against 128``, and how many more; None when nothing does, or
    when ``model`` is no folder with a config. A format-3 resume builds its model from the checkpoint, so another
    ``--model`` would otherwise go unnoticed (format 2 loaded the shards' weights into ``--model``'s, which refused
    another shape)."""
    from transformers import AutoConfig

    try:
        ours, theirs = (AutoConfig.from_pretrained(str(p), local_files_only=True) for p in (checkpoint, model))
    except (OSError, ValueError, KeyError):
        return None
    differ = [f"{k} {getattr(ours, k, None)} against {getattr(theirs, k, None)}" for k in ARCHITECTURE_KEYS
              if getattr(ours, k, None) != getattr(theirs, k, None)]
    more = f", {len(differ) - 3} more" if len(differ) > 3 else ""
    return ", ".join(differ[:3]) + more if differ else None


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def load_v1_optimizer_state(folder: Path) -> dict[str, Any]:
    """The whole optimizer state of a format-1 checkpoint, keyed by parameter name (as
    ``torch.distributed.checkpoint.state_dict`` gives it)."""
    from safetensors.torch import load_file

    folder = folder / V1_OPTIM_DIR
    tensors = load_file(str(folder / V1_OPTIM_TENSORS))
    meta = json.loads((folder / V1_OPTIM_META).read_text())
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
    env: DistEnv,
    config_yaml: str,
    keep_last: int,
    optimizer: bool = True,
) -> Path:
    """Write ``OUT/checkpoints/step_N`` (collective: every rank calls it and writes its shards; rank 0 the rest
    and publishes it); with ``optimizer=False``, the model folder and the state files only (module docstring).
    Returns once it is published, on every rank."""
    root = Path(out) / CKPT_DIR
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    aside = root / f"{OLD_PREFIX}{checkpoint_name(step)}"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        _recover_aside(root)
        for leftover in root.glob(".tmp-step_*"):  # torn saves, of this step or another; none is being written now
            shutil.rmtree(leftover)
        tmp.mkdir()
    env.barrier()  # the leftover tmp folders are gone before any rank writes into one
    weights_apart = backend.exports_held_weights  # the model folder holds them: the shards need not
    if optimizer:
        backend.save_state(tmp / SHARDS_DIR, weights=not weights_apart)
    backend.export_model(tmp)
    if env.is_main:
        state = {
            "version": STATE_VERSION if weights_apart else WEIGHTS_IN_SHARDS,
            "step": step,
            "updates": backend.updates,
            "weight_version": weight_version,
            "world_size": env.world_size,
            "loader_states": loader_states,
        }
        if not optimizer:
            state["optimizer"] = False
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        (tmp / CONFIG_FILE).write_text(config_yaml)
    env.barrier()  # every rank's shards are written before rank 0 checks and publishes the folder
    refused = None
    if env.is_main and optimizer:
        refused = missing_shards(tmp / SHARDS_DIR, env.world_size)
    if env.is_main and refused is None:
        fsync_tree(tmp)
        replaced = final.exists()
        if replaced:
            os.replace(final, aside)  # kept whole until the new folder is in place
        os.replace(tmp, final)
        fsync_dir(root)
        _link_atomic(root / LATEST, final.name)
        if replaced:
            shutil.rmtree(aside)
        _prune(root, keep_last, final)
    # No rank goes on (to the next save of this folder) before it is published; a refusal stops every rank.
    refused = env.all_gather_json(refused)[0]
    if refused:
        raise ValueError(refused)
    return final


def drop_optimizer_state(path: Path, env: DistEnv) -> None:
    """Make the published checkpoint ``path`` model-only (a run's last, saved whole by ``--save-every`` before the
    data was known to end): its state file says so first, replaced atomically, then ``shards/`` goes; a crash
    between the two leaves a model-only checkpoint with unused shards (collective: rank 0 writes, all wait)."""
    if env.is_main:
        state = json.loads((path / STATE_FILE).read_text())
        write_atomic(path / STATE_FILE, json.dumps({**state, "optimizer": False}, indent=1))
        shutil.rmtree(path / SHARDS_DIR, ignore_errors=True)
    env.barrier()


POLICY_DIR = "policy"  # OUT/policy/v_<version>: weights-only exports for an engine (rollshard-loop --async)
POLICY_KEEP = 2  # exports kept: the newest, and the one an engine may still be loading


def export_policy(out: Path, *, step: int, backend: Any, weight_version: str, env: DistEnv) -> Path:
    """Write the policy's weights (no optimizer or loader state) as ``OUT/policy/v_<version>``, a model folder an
    engine loads (``/update_weights_from_disk``) and that says its version (``trainer_state.json``), then link
    ``OUT/policy/latest`` to it (collective, like :func:`save_checkpoint`).

    An export is for serving, not for resuming: it is renamed into place whole (a crashed process leaves no torn
    export behind) but not fsynced, and only the newest :data:`POLICY_KEEP` are kept; the checkpoints stay the
    run's durable state."""
    root = Path(out) / POLICY_DIR
    name = f"v_{int(weight_version):08d}" if str(weight_version).isdigit() else f"v_{weight_version}"
    tmp, final = root / f".tmp-{name}", root / name
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(".tmp-*"):
            shutil.rmtree(leftover)
    env.barrier()
    backend.export_model(tmp)
    if env.is_main:
        state = {"weight_version": weight_version, "step": step, "export": True}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _link_atomic(root / LATEST, final.name)
        for old in sorted(p for p in root.glob("v_*") if p.is_dir() and p != final)[:-(POLICY_KEEP - 1) or None]:
            shutil.rmtree(old, ignore_errors=True)
    env.barrier()
    return final


def latest_policy(out: str | Path) -> tuple[Path, str] | None:
    """The newest policy folder a run offers an engine, and its version: its latest export or checkpoint,
    whichever is newer (a checkpoint is a policy folder too); None before either."""
    found = []
    for link in (Path(out) / POLICY_DIR / LATEST, Path(out) / CKPT_DIR / LATEST):
        if not link.is_symlink():
            continue
        try:
            folder = link.resolve(strict=True)
            state = json.loads((folder / STATE_FILE).read_text())
            found.append((int(state["step"]), folder, str(state["weight_version"])))
        except (OSError, ValueError, KeyError):  # pruned or being replaced under us: the next look finds the new one
            continue
    if not found:
        return None
    _, folder, version = max(found, key=lambda f: f[0])
    return folder, version


def recover(out: str | Path, env: DistEnv) -> None:
    """Finish a re-save that a crash interrupted (:func:`_recover_aside`) before a resume reads ``latest``, which
    names the folder moved aside (collective: rank 0 recovers, every rank waits for it)."""
    root = Path(out) / CKPT_DIR
    if env.is_main and root.is_dir():
        _recover_aside(root)
    env.barrier()


def missing_shards(folder: Path, world_size: int) -> str | None:
    """Why ``folder`` may not be published (a one-line error), or None when every rank of ``world_size`` has
    a shard file in it (rank R's are ``shard-{R + 1:05d}-model-...``, rollshard.train.sharded)."""
    written = {f.name.split("-model-")[0] for f in folder.glob("shard-*-model-*.safetensors")}
    missing = [r for r in range(world_size) if f"shard-{r + 1:05d}" not in written]
    if not missing:
        return None
    return (
        f"{folder} holds no shard file of rank {', '.join(map(str, missing))} (world size {world_size}), so the "
        "checkpoint is not published: under torchrun --out must be on a file system every rank shares"
    )


def fsync_tree(folder: Path) -> None:
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
        fsync_dir(dirpath)


def _recover_aside(root: Path) -> None:
    """Finish a re-save that a crash interrupted: an ``.old-step_N`` is garbage once ``step_N`` exists, and
    the only copy of the step (moved back) when it does not."""
    for old in root.glob(f"{OLD_PREFIX}step_*"):
        final = root / old.name[len(OLD_PREFIX):]
        if final.exists():
            shutil.rmtree(old)
        else:
            os.replace(old, final)
            fsync_dir(root)


def _link_atomic(link: Path, target: str) -> None:
    tmp = link.with_name(link.name + ".tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def _prune(root: Path, keep_last: int, published: Path) -> None:
    """Delete the checkpoints of later steps than ``published`` (an abandoned future, see the module docstring),
    then all but the ``keep_last`` newest up to it; ``published`` itself is always kept."""
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    future = [p for p in done if p.name > published.name]  # zero-padded step numbers: name order is step order
    kept = [p for p in done if p.name <= published.name]
    for old in future + kept[: max(len(kept) - max(keep_last, 1), 0)]:
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
        version=int(state.get("version", 1)),
        step=int(state["step"]),
        updates=int(state["updates"]),
        weight_version=str(state["weight_version"]),
        world_size=int(state["world_size"]),
        loader_states=list(state["loader_states"]),
        optimizer=bool(state.get("optimizer", True)),
    )

"""The format-1 checkpoint writer (rollshard before sharded checkpoints), frozen: what resumes must still read,
and the benchmark's "old" figures (tests/bench/bench_checkpoint.py).

Format 1 gathers everything to rank 0: the whole weights (``get_model_state_dict``, full and on
CPU) into ``save_pretrained``, and the whole AdamW state into ``optimizer/state.safetensors``
(tensors keyed ``<param>::<state>``) + ``optimizer/meta.json`` (parameter groups, non-tensor
state); ``trainer_state.json`` with ``"version": 1``. Collective under FSDP; rank 0 writes. It
writes ``OUT/checkpoints/step_N`` directly and links ``latest`` (the crash-safe protocol around
it is the same in both formats and tested on the live code).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def gather(backend) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Format 1's state: whole weights (transformers names, tied copies dropped) and whole optimizer state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(backend.policy, options=options)
    every = {n for n, _ in backend.hf_model.named_parameters(remove_duplicate=False)}
    tied = every - {n for n, _ in backend.hf_model.named_parameters()}
    model = {k.removeprefix("model."): v for k, v in sd.items() if k.removeprefix("model.") not in tied}
    return model, get_optimizer_state_dict(backend.policy, backend.optimizer, options=options)


def write(folder: Path, backend, model: dict[str, torch.Tensor], optim: dict[str, Any]) -> None:
    """Rank 0's part: the model folder and the optimizer files of format 1."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in backend.source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, folder / f.name)
    backend.hf_model.save_pretrained(folder, state_dict=model)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    cfg["use_cache"] = json.loads((backend.source / "config.json").read_text()).get("use_cache", True)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    opt = folder / "optimizer"
    opt.mkdir()
    tensors, scalars = {}, {}
    for param, entries in optim["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param}::{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(param, {})[key] = value
    save_file(tensors, str(opt / "state.safetensors"))
    (opt / "meta.json").write_text(json.dumps({"param_groups": optim["param_groups"], "scalars": scalars}, default=list))


def save_v1(out: Path, *, step: int, backend, loader_states: list[dict[str, Any]], weight_version: str,
            world_size: int = 1, is_main: bool = True, config_yaml: str = "trainer: {}\n") -> Path:
    model, optim = gather(backend)
    root = Path(out) / "checkpoints"
    final = root / f"step_{step:08d}"
    if is_main:
        write(final, backend, model, optim)
        state = {"version": 1, "step": step, "updates": backend.updates, "weight_version": weight_version,
                 "world_size": world_size, "loader_states": loader_states}
        (final / "trainer_state.json").write_text(json.dumps(state, indent=1))
        (final / "train_config.yaml").write_text(config_yaml)
        link = root / "latest"
        if link.is_symlink():
            link.unlink()
        link.symlink_to(final.name)
    return final

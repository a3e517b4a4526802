"""What ``rollshard-train`` resolves before anything is loaded: the settings that depend on files.

``--model`` must be a local folder (made absolute, ``checkpoints/latest`` resolved); the
initial weight version is that of a rollshard checkpoint folder (else 0;
``--initial-version`` wins); ``--out`` may not be the dataset, inside it, or a model
folder (with several ``--data`` sources: any of them). Dr. GRPO's ``--norm-len`` defaults
to a constant of the run, the most loss tokens a row can hold by the dataset's generation
config (:func:`run_norm_len`; of a mixture, the largest over its sources).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rollshard.store.io.destination import check_out_folder
from rollshard.store.models.gguf import is_gguf
from rollshard.store.models.versions import folder_weight_version, resolve_model_path
from rollshard.train.config import TrainConfig

# rollshard-generate agent systems whose rows hold one model turn (tool_loop records its "turns").
SINGLE_TURN_AGENTS = frozenset({"single", "multi_agent"})


def prepare_config(config: TrainConfig) -> TrainConfig:
    """A copy of ``config`` with the file-dependent settings resolved: the model folder (absolute, links
    resolved) and the initial weight version; ``--out`` checked against the dataset and model folders. The
    config is validated first (the command line does it too; a config built in Python must not skip it)."""
    config.validate(require_paths=True)
    model = check_model_path(config.model.path)
    version = config.trainer.initial_version
    if version is None:
        version = initial_version_of(model)
    check_out_dir(config.trainer.out, data=config.data.path)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=model),
        trainer=dataclasses.replace(config.trainer, initial_version=version),
    )


def check_model_path(path: str) -> str:
    """``--model`` as an absolute local folder. Anything else fails here, at once: transformers would try a
    path-shaped name on the Hub (with retries) before failing, and the checkpoints copy the tokenizer files
    from the folder."""
    p = Path(path).expanduser()
    if p.is_dir() or (p.is_file() and is_gguf(p)):
        return resolve_model_path(p)  # a GGUF file: its converted folder
    if p.exists():
        raise ValueError(f"--model {path} is a file; pass the model's folder (config.json and weights) or a .gguf file")
    if "/" in path or path.startswith((".", "~")):
        raise ValueError(f"--model {path}: no such folder; check the path (a Hugging Face model folder)")
    raise ValueError(
        f"--model {path}: no such local folder; rollshard-train needs one, download it first "
        f"(huggingface-cli download {path} --local-dir DIR) and pass --model DIR"
    )


def initial_version_of(model: str) -> int:
    """The weight version of a rollshard checkpoint folder (its trainer_state.json), else 0."""
    version = folder_weight_version(model)
    if version is None:
        return 0
    try:
        return int(version)
    except ValueError:
        raise ValueError(
            f"--model {model} has weight_version {version!r}, not an integer; pass --initial-version N"
        ) from None


def check_out_dir(out: str, *, data: str) -> None:
    """Refuse an output folder that would write into a dataset of ``--data`` (any source of a mixture) or over a
    model folder."""
    from rollshard.store.loader.mixture import parse_sources

    o = Path(out).expanduser().resolve()
    for source in parse_sources(data):
        if "://" in source.path:
            continue
        d = Path(source.path).expanduser().resolve()
        if o == d or d in o.parents:
            raise ValueError(
                f"--out {out} is the dataset or inside it ({source.path}); choose a directory outside the dataset"
            )
    if o.exists() and not o.is_dir():
        raise ValueError(f"--out {out} is a file; choose a directory")
    if (o / "config.json").is_file():
        raise ValueError(f"--out {out} is a model folder (it has config.json); choose a new directory for the run")
    check_out_folder(out, accepts=run_entries(), kind="a rollshard-train run folder",
                     fix="choose a new or empty directory, or a run's folder to resume it (--resume)")


def run_entries() -> frozenset[str]:
    """What a training run's folder holds: checkpoints, weights-only policy exports, metrics, TensorBoard events,
    the wandb run (and wandb's own folder when it is written there)."""
    from rollshard.train.checkpoint import CKPT_DIR, POLICY_DIR
    from rollshard.train.loggers import METRICS_FILE, WANDB_RUN_FILE

    return frozenset({CKPT_DIR, POLICY_DIR, METRICS_FILE, "tb", WANDB_RUN_FILE, "wandb"})  # tb: TensorBoard's


def run_norm_len(configs: list[dict[str, Any]]) -> int | None:
    """Dr. GRPO's length constant from the generation configs of a dataset's writers: the most loss tokens a
    row can hold, ``sampling.max_new_tokens`` per model turn times the model turns of a row (environment
    tokens carry no loss). None when a config does not tell."""
    lengths = []
    for c in configs:
        sampling = c.get("sampling") if isinstance(c, dict) else None
        agents = c.get("agents") if isinstance(c, dict) else None
        max_new = sampling.get("max_new_tokens") if isinstance(sampling, dict) else None
        turns = None
        if isinstance(agents, dict):
            turns = agents.get("turns", 1 if agents.get("name") in SINGLE_TURN_AGENTS else None)
        if not (isinstance(max_new, int) and max_new > 0 and isinstance(turns, int) and turns > 0):
            return None
        lengths.append(max_new * turns)
    return max(lengths, default=None)

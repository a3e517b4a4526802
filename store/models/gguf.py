"""GGUF files as models: a ``.gguf`` file is accepted wherever a model folder is.

transformers dequantizes a GGUF checkpoint into an fp32 model (with its tokenizer and chat
template) but will not save a model still marked quantized, so :func:`convert_gguf` copies
the weights into a fresh model of the same config without ``quantization_config`` and saves
a plain Hugging Face folder. :func:`gguf_folder` does this once per file content: the folder
is cached under ``ROLLSHARD_CACHE`` (default ``${XDG_CACHE_HOME:-~/.cache}/rollshard``) at
``gguf/<sha256 prefix>``, and records where it came from in ``rollshard_source.json``
(the file's name and sha256), which generation writes into the run config, so a dataset
names the exact weights it was generated with.

Needs the ``gguf`` and ``accelerate`` packages (``pip install 'rollshard[gguf]'``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from rollshard.store.common import file_sha256

SOURCE_FILE = "rollshard_source.json"
HASH_PREFIX = 16  # hex digits of the sha256 naming the cached folder


class GGUFError(ValueError):
    """A GGUF file could not be converted (missing packages, unreadable or unsupported file)."""


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


def cache_dir() -> Path:
    root = os.environ.get("ROLLSHARD_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollshard"
    return Path(root).expanduser()


def gguf_source(folder: str | os.PathLike) -> dict[str, Any] | None:
    """What a converted folder came from (``{"gguf": name, "sha256": ...}``); None for any other folder."""
    p = Path(folder) / SOURCE_FILE
    try:
        return json.loads(p.read_text()) if p.is_file() else None
    except (OSError, ValueError):
        return None


def gguf_folder(path: str | os.PathLike, *, quiet: bool = False) -> Path:
    """The fp32 Hugging Face folder of a GGUF file, converted on first use and cached by content (under a lock:
    concurrent first uses on one machine convert it once)."""
    src = Path(path).expanduser()
    if not src.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    digest = file_sha256(src)
    folder = cache_dir() / "gguf" / digest[:HASH_PREFIX]
    if (folder / SOURCE_FILE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion of a file at a time; the others wait and reuse it
        if (folder / SOURCE_FILE).is_file():
            return folder
        if not quiet:
            print(f"converting {src.name} to an fp32 model folder at {folder} (once; later runs reuse it)",
                  file=sys.stderr)
        convert_gguf(src, folder, sha256=digest)
    return folder


def convert_gguf(src: str | os.PathLike, out: str | os.PathLike, *, sha256: str | None = None) -> Path:
    """Write the fp32 Hugging Face folder of the GGUF file ``src`` at ``out`` (built under a temporary name,
    then renamed: a reader never sees half of it)."""
    src, out = Path(src).expanduser().resolve(), Path(out).expanduser()
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise GGUFError(
            f"reading {src.name} needs the gguf and accelerate packages ({e.name} is missing); "
            "pip install 'rollshard[gguf]'"
        ) from e
    hf_logging.disable_progress_bar()
    try:
        kw = {"gguf_file": src.name}
        quantized = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32, **kw)
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kw)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise GGUFError(f"cannot read {src} as a GGUF model: {' '.join(str(e).split())[:300]}") from e
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config = AutoConfig.for_model(**config.to_dict())  # a plain config of the same architecture
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight") or not config.tie_word_embeddings]:
        raise GGUFError(f"{src.name}: the dequantized weights do not fit a {config.model_type} model "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.generation_config = quantized.generation_config
    source = {"gguf": src.name, "sha256": sha256 or file_sha256(src)}
    return save_model_folder(
        out, model, tokenizer, lambda tmp: (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    )


def copy_model_folder(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """A copy of the model folder ``src`` at ``out``, replacing what is there (:func:`write_folder`)."""
    return write_folder(out, lambda tmp: shutil.copytree(src, tmp, dirs_exist_ok=True))


def save_model_folder(out: str | os.PathLike, model, tokenizer, finish=lambda folder: None) -> Path:
    """Save ``model`` and ``tokenizer`` as a Hugging Face folder at ``out``, replacing what is there
    (:func:`write_folder`); ``finish(folder)`` adds to it."""

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        finish(tmp)

    return write_folder(out, fill)


def write_folder(out: str | os.PathLike, fill: Callable[[Path], Any]) -> Path:
    """The folder ``out``, all or nothing: ``fill(tmp)`` writes it under a temporary name beside it, then it is
    renamed over what was there, so a reader never sees half of it (a failure in ``fill`` leaves ``out`` as it was)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fill(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

"""Where a relative path given to a notebook (``ROLLSHARD_DATASET``, ``ROLLSHARD_METRICS``) or stored in a
run config (the model the tokenizer comes from) points.

A Jupyter kernel runs in the notebook's folder, not where ``jupyter lab`` was launched, so
``ROLLSHARD_DATASET=runs/demo jupyter lab notebooks/inspect_rollouts.ipynb`` would otherwise look in
``notebooks/runs/demo``. A relative path is tried, in order: as given (the current directory); the
launch directory (``$PWD``, which the shell sets and the Jupyter server passes on to its kernels
unchanged); the repository root, the nearest folder above the notebook holding ``pyproject.toml``;
and, for a path from a run config, every folder above the dataset (``rollshard-generate`` ran in one
of them). The first that exists wins. A URI (``s3://...``) or an absolute path is kept as given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from rollshard.store.inspection.stats import tokenizer_path

ROOT_MARKER = "pyproject.toml"


def is_uri(path: str) -> bool:
    return "://" in str(path)


def repo_root(start: str | os.PathLike | None = None) -> Path | None:
    """The nearest folder at or above ``start`` (default: the current directory) holding ``pyproject.toml``."""
    here = Path(start if start is not None else os.getcwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / ROOT_MARKER).is_file():
            return folder
    return None


def search_dirs(near: str | os.PathLike | None = None, extra: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """The folders a relative path is tried against, best first, without repeats."""
    dirs: list[Path] = [Path.cwd()]
    if os.environ.get("PWD"):
        dirs.append(Path(os.environ["PWD"]))
    root = repo_root(near)
    if root is not None:
        dirs.append(root)
    dirs.extend(Path(d) for d in extra)
    seen, out = set(), []
    for d in dirs:
        key = str(d.resolve()) if d.exists() else str(d)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def resolve_path(path: str | os.PathLike, *, near: str | os.PathLike | None = None, what: str = "path") -> str:
    """``path`` made absolute against the first of :func:`search_dirs` where it exists.

    Raises FileNotFoundError naming every place tried when it exists in none of them."""
    text = os.path.expanduser(str(path))
    if is_uri(text) or os.path.isabs(text):
        return text
    tried = []
    for d in search_dirs(near):
        candidate = d / text
        if candidate.exists():
            return str(candidate.resolve())
        tried.append(str(candidate))
    raise FileNotFoundError(f"{what} {text!r} not found; tried {', '.join(tried)}")


def resolve_paths(spec: str, *, near: str | os.PathLike | None = None, what: str = "dataset") -> list[str]:
    """A comma-separated list of paths (several datasets: consecutive rounds), each resolved."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise FileNotFoundError(f"no {what} given")
    return [resolve_path(p, near=near, what=what) for p in parts]


def dataset_tokenizer(config: dict, dataset_uri: str, *, near: str | os.PathLike | None = None) -> str | None:
    """The tokenizer folder named in a dataset's run config, a relative one resolved as the module says."""
    extra = []
    if not is_uri(dataset_uri):
        ds = Path(dataset_uri).resolve()
        extra = list(ds.parents)  # the run wrote OUT relative to one of these
    return tokenizer_path(config, base_dirs=[str(d) for d in search_dirs(near, extra)])

"""The ``--out`` of every command that writes: a folder may hold only the command's own kind of output, and a
file may only replace one of its own kind, so that a mistyped ``--out`` never mixes a run into a model folder or
writes over someone's file. Each writer calls :func:`check_out_folder` (or :func:`check_out_file`) with what it
accepts, before any work; the refusal is a :class:`~rollshard.store.common.UsageError`, one line saying what is
there and how to fix it. A URI is not looked at (an object store's prefix is checked by the writer itself)."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Callable, Collection

from rollshard.store.common import UsageError

SHOWN = 3  # entries named in the refusal; the rest are counted


def foreign_entries(path: str | os.PathLike, accepts: Collection[str]) -> list[str]:
    """The entries of the local folder ``path`` that match none of ``accepts`` (names or fnmatch patterns),
    sorted; dot-files (locks, temporary files) aside. Empty for a missing folder or a URI."""
    folder = Path(path).expanduser()
    if "://" in os.fspath(path) or not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir()
                  if not p.name.startswith(".") and not any(fnmatch.fnmatchcase(p.name, a) for a in accepts))


def check_out_folder(path: str | os.PathLike, *, accepts: Collection[str], kind: str, fix: str,
                     flag: str = "--out") -> None:
    """Refuse a ``path`` that is a file, or a folder holding an entry ``accepts`` does not name. ``kind``: what
    the folder should be ("a rollshard dataset"); ``fix``: what to give instead."""
    text = os.fspath(path)
    if "://" not in text and Path(text).expanduser().is_file():
        raise UsageError(f"{flag} {text} is a file, not {kind}; {fix}")
    foreign = foreign_entries(text, accepts)
    if foreign:
        shown = ", ".join(foreign[:SHOWN]) + (f" and {len(foreign) - SHOWN} more" if len(foreign) > SHOWN else "")
        raise UsageError(f"{flag} {text} holds {shown}: not {kind}; {fix}")


def check_out_file(path: str | os.PathLike, *, own: Callable[[Path], bool], kind: str, fix: str,
                   flag: str = "--out") -> None:
    """Refuse a ``path`` that is an existing local file ``own`` does not recognize as the command's output
    (replacing one of its own is a rerun)."""
    text = os.fspath(path)
    p = Path(text).expanduser()
    if "://" in text or not p.is_file() or own(p):
        return
    raise UsageError(f"{flag} {text} is a file that is not {kind}; {fix}")

"""Copy a virtualenv to a new path, where it runs as if it had been created there.

    python scripts/copy_venv.py SRC DST

A virtualenv records its own absolute path in ``pyvenv.cfg`` and in the scripts of ``bin/`` (the console scripts'
``#!`` lines, ``activate``); the copy has them rewritten to DST, byte for byte otherwise (``cp -a``: modes, times,
the links to the base interpreter). The copy is written beside DST and renamed to it at the end, so an interrupted
copy is never taken for a virtualenv; DST must not exist. ``scripts/setup.sh`` keeps a copy of a fresh ``.venv`` with
it and makes the next clone's ``.venv`` from that copy. Exit 0 done, 1 failed (DST left absent).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def copy_venv(src: Path, dst: Path) -> None:
    src, dst = src.resolve(), dst.parent.resolve() / dst.name
    if not (src / "pyvenv.cfg").is_file():
        raise ValueError(f"{src} is not a virtualenv (no pyvenv.cfg)")
    if dst.exists() or dst.is_symlink():
        raise ValueError(f"{dst} exists")
    part = dst.with_name(f"{dst.name}.part-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    try:
        subprocess.run(["cp", "-a", str(src), str(part)], check=True)
        old, new = bytes(src), bytes(dst)
        for f in [part / "pyvenv.cfg", *(part / "bin").iterdir()]:
            if f.is_symlink() or not f.is_file():
                continue
            data = f.read_bytes()
            if old in data and b"\0" not in data:
                f.write_bytes(data.replace(old, new))
        os.rename(part, dst)  # fails if DST appeared meanwhile (another set-up kept its copy first)
    finally:
        shutil.rmtree(part, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/copy_venv.py SRC DST", file=sys.stderr)
        return 2
    try:
        copy_venv(Path(argv[0]), Path(argv[1]))
    except (OSError, ValueError, subprocess.CalledProcessError) as e:
        print(f"copy_venv: cannot copy {argv[0]} to {argv[1]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

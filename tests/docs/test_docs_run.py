"""The docs tier: every command block of the README and docs/ runs in order, as written (``pytest -m docs``).

The blocks run in one working folder, as one reader's session would: a fresh folder holding links to the
repository's files (so ``examples/...`` and ``.venv`` resolve and ``runs/`` starts empty), each block a
``bash -euo pipefail`` script in the set-up's virtualenv (the README activates it once per shell). A block that
fails fails its test, with its text and the tail of its output; the blocks after it still run and say what they
miss.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, Block, command_blocks

pytestmark = [pytest.mark.docs, pytest.mark.timeout(900)]

BLOCKS = [b for b in command_blocks() if b.not_run is None]
BLOCK_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def session_dir(tmp_path_factory) -> Path:
    here = tmp_path_factory.mktemp("reader")
    for entry in ROOT.iterdir():
        if entry.name not in {"runs", ".git"}:
            (here / entry.name).symlink_to(entry)
    return here


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs_as_written(block: Block, session_dir: Path) -> None:
    script = f"source .venv/bin/activate\n{block.text}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSHARD_", "PYTEST_", "WANDB_"))}
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=session_dir, env=env,
                       capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-12000:]  # several processes' tracebacks (torchrun's ranks)
        pytest.fail(f"{block.id} exited {p.returncode}:\n{block.text}\n--- output (tail) ---\n{tail}", pytrace=False)

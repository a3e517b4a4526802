"""The docs tier: every command block of the README and docs/ runs in order, as written (``pytest -m docs``).

The blocks run in one working folder, as one reader's session would: a fresh folder holding links to the
repository's files (so ``examples/...`` and ``.venv`` resolve and ``runs/`` starts empty), each block a
``bash -euo pipefail`` script in the set-up's virtualenv (the README activates it once per shell). A block that
fails fails its test, with its text and the tail of its output; the blocks after it still run and say what they
miss. Blocks marked with a session of their own run in tests/docs/test_docs_sessions.py, beside this chain.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import BLOCK_TIMEOUT_S, Block, command_blocks, failure, reader_folder, run_block

pytestmark = [pytest.mark.docs, pytest.mark.timeout(BLOCK_TIMEOUT_S)]

BLOCKS = [b for b in command_blocks() if b.not_run is None and b.session is None]


@pytest.fixture(scope="module")
def session_dir(tmp_path_factory) -> Path:
    return reader_folder(tmp_path_factory.mktemp("reader"))


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs_as_written(block: Block, session_dir: Path) -> None:
    done = run_block(block, session_dir)
    if done.returncode != 0:
        pytest.fail(failure(block, done), pytrace=False)

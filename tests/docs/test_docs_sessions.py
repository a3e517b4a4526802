"""The docs tier's blocks that run in a session of their own (``<!-- session: NAME -->``): each name a fresh
reader's folder, its blocks in reading order. This module is a chain of its own, so pytest-xdist runs it beside
the main one (tests/docs/test_docs_run.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import BLOCK_TIMEOUT_S, Block, command_blocks, failure, reader_folder, run_block

pytestmark = [pytest.mark.docs, pytest.mark.timeout(BLOCK_TIMEOUT_S)]

BLOCKS = [b for b in command_blocks() if b.not_run is None and b.session is not None]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict[str, Path]:
    return {name: reader_folder(tmp_path_factory.mktemp(f"reader-{name}")) for name in {b.session for b in BLOCKS}}


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.id}@{b.session}" for b in BLOCKS])
def test_block_runs_as_written_in_its_session(block: Block, sessions: dict[str, Path]) -> None:
    done = run_block(block, sessions[block.session])
    if done.returncode != 0:
        pytest.fail(failure(block, done), pytrace=False)

"""Shared fixtures: tiny local models (built once per test session, never downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A tiny random GPT-2-architecture model folder (the real SGLang server can run it on CPU)."""
    from rollshard.generate.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-gpt2", preset="tiny-gpt2", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """A tiny random Qwen3-architecture model folder."""
    from rollshard.generate.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", preset="tiny-qwen3", seed=0)

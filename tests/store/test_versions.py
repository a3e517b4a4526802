"""Checkpoint folders' weight versions and resolved model paths (store/models/versions.py)."""

from __future__ import annotations

import json
import os

import pytest

from rollshard.store.models.versions import VersionError, folder_weight_version, resolve_model_path


def test_version_of_a_checkpoint_folder_and_of_others(tmp_path):
    assert folder_weight_version(tmp_path) is None  # a folder that is not a rollshard checkpoint
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 12, "weight_version": "12"}))
    assert folder_weight_version(tmp_path) == "12"
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 3, "weight_version": 3}))
    assert folder_weight_version(tmp_path) == "3"


@pytest.mark.parametrize("text", ['{"weight_version": ', "[1, 2]", '"12"'])
def test_a_broken_state_file_is_one_error(tmp_path, text):
    (tmp_path / "trainer_state.json").write_text(text)
    with pytest.raises(VersionError, match="trainer_state.json: (unreadable checkpoint state|not a checkpoint state)"):
        folder_weight_version(tmp_path)


def test_resolve_model_path_follows_links(tmp_path):
    (tmp_path / "step_00000003").mkdir()
    os.symlink("step_00000003", tmp_path / "latest")
    assert resolve_model_path(tmp_path / "latest") == str((tmp_path / "step_00000003").resolve())
    assert resolve_model_path("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # not a local path: kept as given

"""A model folder's fingerprint: the same weights anywhere give the same one, other weights another."""

from __future__ import annotations

import shutil

from rollshard.store.models import fingerprint as fp
from rollshard.store.models.fingerprint import model_fingerprint


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_copy_is_the_same_model_and_one_changed_byte_is_another(tiny_gpt2, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_gpt2, copy)
    assert model_fingerprint(tiny_gpt2) is not None and model_fingerprint(copy) == model_fingerprint(tiny_gpt2)
    weights = copy / "model.safetensors"
    flip(weights, weights.stat().st_size - 1)  # the last byte of the last tensor
    assert model_fingerprint(copy) != model_fingerprint(tiny_gpt2)


def test_a_large_file_is_sampled(tmp_path, monkeypatch):
    # A 1000-byte file over a 100-byte whole-file limit: 3 blocks of 10 bytes at offsets 0, 495 and 990
    # ((1000 - 10) * i // 2).
    monkeypatch.setattr(fp, "WHOLE_FILE_BYTES", 100)
    monkeypatch.setattr(fp, "SAMPLES", 3)
    monkeypatch.setattr(fp, "SAMPLE_BYTES", 10)
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(range(250)) * 4)
    before = model_fingerprint(tmp_path)
    flip(weights, 300)  # between the blocks: not read
    assert model_fingerprint(tmp_path) == before
    flip(weights, 497)  # inside the middle block
    assert model_fingerprint(tmp_path) != before


def test_what_is_not_a_local_model_folder_has_none(tmp_path):
    assert model_fingerprint(tmp_path / "nowhere") is None
    assert model_fingerprint("org/some-hub-model") is None
    (tmp_path / "config.json").write_text("{}")
    assert model_fingerprint(tmp_path) is None  # no weight file

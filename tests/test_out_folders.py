"""Every command that writes refuses an ``--out`` holding something other than its own kind of output: one line
saying what is there and how to fix it, exit 2, nothing written (the folder or file is left as it was)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollshard.store.io.writer import ShardWriter
from rollshard.store.synthetic import synthetic_table
from tests import forked

STRAY = "notes.txt"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("parent") / "ds"
    with ShardWriter(root, config={"task": "toy"}) as w:
        w.write_groups(synthetic_table(4, 2, seed=1))
    return root


@pytest.fixture
def model_folder(tiny_gpt2, tmp_path) -> Path:
    """A copy of a model folder (config.json, weights, tokenizer): the --out a slip of the keyboard gives."""
    return shutil.copytree(tiny_gpt2, tmp_path / "model")


@pytest.fixture
def stray_folder(tmp_path) -> Path:
    """A folder holding one file of someone's."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / STRAY).write_text("keep me\n")
    return folder


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"" for p in sorted(path.rglob("*"))}


def _refused(argv: list[str], out: Path) -> str:
    """Run ``python -m argv``; its one error line, after checking exit 2, no traceback and ``out`` unchanged."""
    before = _snapshot(out) if out.is_dir() else out.read_bytes()
    res = forked.run(*argv)
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and "Traceback" not in res.stderr, res.stderr
    assert (_snapshot(out) if out.is_dir() else out.read_bytes()) == before
    return line


def test_store_filter(dataset, model_folder):
    line = _refused(["rollshard.store", "filter", dataset, "--min-reward", "0", "--out", model_folder], model_folder)
    assert line.startswith(f"rollshard-store: error: --out {model_folder} holds chat_template.jinja, config.json, ")
    assert line.endswith(": not a rollshard dataset; give a new or empty folder, or the unfinished output of this "
                         "filter to resume")


def test_store_report(dataset, stray_folder):
    page = stray_folder / STRAY
    line = _refused(["rollshard.store", "report", dataset, "--out", page, "--no-progress"], page)
    assert line == (f"rollshard-store: error: --out {page} is a file that is not a rollshard report page; name a "
                    "new file, or a page this command wrote to replace it")


def test_store_report_replaces_its_own_page(dataset, tmp_path):
    page = tmp_path / "report.html"
    for _ in range(2):  # the rerun replaces the page it wrote
        res = subprocess.run([sys.executable, "-m", "rollshard.store", "report", str(dataset), "--out", str(page),
                              "--no-progress"], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr


def test_generate(tiny_gpt2, model_folder):
    line = _refused(["rollshard.generate", "--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--limit", "1",
                     "--out", model_folder, "--no-progress"], model_folder)
    assert line == (f"rollshard-generate: error: --out {model_folder} holds chat_template.jinja, config.json, "
                    "generation_config.json and 3 more: not a rollshard dataset; give a new or empty folder, or a "
                    "dataset to resume")


def test_generate_eval(tiny_gpt2, model_folder):
    line = _refused(["rollshard.generate", "eval", "--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--limit",
                     "1", "--out", model_folder, "--no-progress"], model_folder)
    assert f"--out {model_folder} holds chat_template.jinja, config.json, " in line
    assert "not a rollshard dataset" in line


def test_generate_rescore(dataset, model_folder):
    line = _refused(["rollshard.generate", "rescore", dataset, "--task", "toy", "--agents", "single", "--out",
                     model_folder, "--no-progress"], model_folder)
    assert line.startswith(f"rollshard-generate rescore: error: --out {model_folder} holds chat_template.jinja, ")
    assert line.endswith("not a rollshard dataset; give a new or empty folder, or the unfinished output of this "
                         "rescore to resume")


def test_train(dataset, tiny_gpt2, stray_folder):
    line = _refused(["rollshard.train", "--data", dataset, "--model", tiny_gpt2, "--out", stray_folder,
                     "--groups-per-step", "2", "--no-progress"], stray_folder)
    assert line == (f"rollshard-train: error: --out {stray_folder} holds {STRAY}: not a rollshard-train run folder; "
                    "choose a new or empty directory, or a run's folder to resume it (--resume)")


def test_train_audit(dataset, tiny_gpt2, stray_folder):
    report = stray_folder / STRAY
    line = _refused(["rollshard.train", "audit", "--data", dataset, "--model", tiny_gpt2, "--out", report], report)
    assert line == (f"rollshard-train audit: error: --out {report} is a file that is not a rollshard-train audit "
                    "report; name a new file, or a report this command wrote to replace it")


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["rounds", "async"])
def test_loop(tiny_gpt2, stray_folder, mode):
    line = _refused(["rollshard.train.loop", *mode, "--model", tiny_gpt2, "--out", stray_folder, "--dry-run"],
                    stray_folder)
    assert line == (f"rollshard-loop: error: --out {stray_folder} holds {STRAY}: not a rollshard-loop run folder; "
                    "choose a new or empty folder, or an earlier run's to continue it")

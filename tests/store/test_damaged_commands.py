"""A damaged shard under every command that reads a whole dataset, and an --out that is another kind of folder:
one line naming the shard (and its row group), exit 2, nothing written."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter
from tests import forked


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> Path:
    """A dataset whose one byte in the middle of row group 0 is flipped (a data page: its footer still reads, so
    only the checksums can tell)."""
    root = tmp_path_factory.mktemp("damaged") / "ds"
    with ShardWriter(root, config={"task": "toy"}) as w:
        w.write_groups(synthetic_table(12, 4, seed=1, prompt_len=(20, 40), response_len=(20, 60)))
    ds = RolloutDataset.open(root)
    rg = ds.shards[0].row_groups[0]
    shard = Path(ds.files[0])
    data = bytearray(shard.read_bytes())
    data[rg.offset + rg.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return root


def _cut(kind: str, tmp_path_factory) -> Path:
    """A dataset whose shard is cut to half its size ("truncated"), or keeps its size with the footer's last 8
    bytes (its length and magic) zeroed ("unreadable": not Parquet)."""
    root = tmp_path_factory.mktemp(kind) / "ds"
    with ShardWriter(root, config={"task": "toy"}) as w:
        w.write_groups(synthetic_table(12, 4, seed=1, prompt_len=(20, 40), response_len=(20, 60)))
    shard = Path(RolloutDataset.open(root).files[0])
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if kind == "truncated" else data[:-8] + bytes(8))
    return root


@pytest.fixture(scope="module")
def truncated(tmp_path_factory) -> Path:
    return _cut("truncated", tmp_path_factory)


@pytest.fixture(scope="module")
def unreadable(tmp_path_factory) -> Path:
    return _cut("unreadable", tmp_path_factory)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return forked.run(*argv)


COMMANDS = [
    ["rollshard.store", "stats"], ["rollshard.store", "inspect"], ["rollshard.store", "report", "--out", "{out}/r.html"],
    ["rollshard.store", "filter", "--min-reward", "0", "--out", "{out}/f"],
    ["rollshard.store", "filter", "--agent", "policy", "--out", "{out}/f"],  # --agent reads the agents first
    ["rollshard.generate", "rescore", "--task", "toy", "--agents", "single", "--out", "{out}/r"],
]
COMMAND_IDS = ["stats", "inspect", "report", "filter", "filter-agent", "rescore"]


def _refused(command: list[str], dataset: Path, out: Path) -> str:
    """Run ``command`` on ``dataset``; its one error line, after checking exit 2, no traceback, nothing written."""
    module, *rest = command
    rest = [a.replace("{out}", str(out)) for a in rest]
    res = _run(module, *rest[:1], str(dataset), *rest[1:])
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and "Traceback" not in res.stderr
    assert list(out.iterdir()) == []  # no page, no half-written dataset
    return line


@pytest.mark.parametrize("command", COMMANDS, ids=COMMAND_IDS)
def test_a_damaged_shard_is_one_line_exit_2_and_nothing_written(damaged, tmp_path, command):
    line = _refused(command, damaged, tmp_path)
    assert f"{damaged}: shards/" in line and "(row group 0, bytes" in line and "xxh3" in line
    assert "the shard was damaged or changed after it was committed" in line


@pytest.mark.parametrize("command", COMMANDS, ids=COMMAND_IDS)
def test_a_truncated_shard_is_one_line_exit_2_and_nothing_written(truncated, tmp_path, command):
    line = _refused(command, truncated, tmp_path)
    (shard,) = (truncated / "shards").glob("*.parquet")
    assert f"{truncated}: shards/{shard.name}: {shard.stat().st_size} bytes on disk, the manifest says " in line
    assert "the shard changed after it was committed" in line


@pytest.mark.parametrize("command", COMMANDS, ids=COMMAND_IDS)
def test_a_shard_not_readable_as_parquet_is_one_line_exit_2_and_nothing_written(unreadable, tmp_path, command):
    line = _refused(command, unreadable, tmp_path)
    (shard,) = (unreadable / "shards").glob("*.parquet")
    assert f"{unreadable}: shards/{shard.name}: not readable as Parquet (" in line


def test_generate_refuses_an_out_that_is_another_kind_of_folder(tiny_gpt2, tmp_path):
    model = shutil.copytree(tiny_gpt2, tmp_path / "model")
    before = sorted(p.name for p in model.iterdir())
    res = _run("rollshard.generate", "--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--limit", "1",
               "--out", str(model), "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == (f"rollshard-generate: error: --out {model} holds chat_template.jinja, config.json, "
                                  f"generation_config.json and 3 more: not a rollshard dataset; give a new or empty "
                                  "folder, or a dataset to resume")
    assert sorted(p.name for p in model.iterdir()) == before

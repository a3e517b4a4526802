"""rollshard-store validate: a clean dataset passes; each kind of damage is found in the right shard."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rollshard.store.commands import main
from rollshard.store.format.manifest import Manifest, ShardInfo
from rollshard.store.format.schema import META_CONFIG, META_SCHEMA_VERSION, SCHEMA_VERSION, Row, Status, rows_to_table
from rollshard.store.io.storage import Storage
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.validate import validate_dataset
from rollshard.store.io.writer import ShardWriter
from tests import forked

SMALL = dict(group_size=3, response_len=(5, 30), prompt_len=(3, 10), agents=("solver", "rewriter"))


def validate(*args) -> subprocess.CompletedProcess:
    return forked.run("rollshard.store", "validate", *args, timeout=120)


def row(sid: str, group: str, *, tokens: list[int], logprobs: list[float], mask: list[int]) -> Row:
    return Row(sample_id=sid, prompt_id=group.split("/")[0], group_id=group, agent="solver", round=0,
               prompt_tokens=[7, 8], response_tokens=tokens, rollout_logprobs=logprobs, loss_mask=mask,
               reward=1.0, status=Status.COMPLETED, finish_reason="stop", weight_version="0", temperature=1.0)


def register_raw_shard(root: Path, writer_id: str, rows: list[Row], schema_version: str = SCHEMA_VERSION) -> str:
    """Write rows with pyarrow directly (no writer, no checks), one row per row group, and list the
    shard in a manifest of its own with the right size, checksum and counts."""
    rel = f"shards/{writer_id}-00000.parquet"
    (root / "shards").mkdir(parents=True, exist_ok=True)
    table = rows_to_table(rows).replace_schema_metadata(
        {META_SCHEMA_VERSION: schema_version.encode(), META_CONFIG: b"{}"})
    pq.write_table(table, root / rel, row_group_size=1)
    storage = Storage(root)
    info = ShardInfo(path=rel, rows=len(rows), groups=len({r.group_id for r in rows}),
                     prompt_tokens=sum(len(r.prompt_tokens) for r in rows),
                     response_tokens=sum(len(r.response_tokens) for r in rows),
                     bytes=storage.size(rel), sha256=storage.sha256(rel), writer_id=writer_id,
                     created_at="2026-01-01T00:00:00.000+00:00")
    Manifest(writer_id=writer_id, shards=[info]).save(storage)
    return rel


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """Writer a: shards a-00000 (groups ap0..ap2) and a-00001 (ap3..ap5); writer b: b-00000 (bp0..bp3)."""
    root = tmp_path_factory.mktemp("clean") / "ds"
    with ShardWriter(root, writer_id="a") as w:
        table = synthetic_table(6, seed=1, prefix="a", **SMALL)
        w.write_groups(table.slice(0, 9))
        w.commit()
        w.write_groups(table.slice(9))
    with ShardWriter(root, writer_id="b") as w:
        w.write_groups(synthetic_table(4, seed=2, prefix="b", **SMALL))
    return root


@pytest.fixture(scope="module")
def broken(clean, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("broken") / "ds"
    shutil.copytree(clean, root)
    # a-00000: one byte flipped in the middle of the file
    shard = root / "shards/a-00000.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # a-00001: gone
    (root / "shards/a-00001.parquet").unlink()
    # raw-00000: rows that break invariants, written around the writer
    register_raw_shard(root, "raw", [
        row("raw-0", "raw/g", tokens=[1, 2, 3], logprobs=[-0.1, -0.2, 0.5], mask=[1, 1, 1]),
        row("raw-1", "raw/g", tokens=[1, 2, 3, 4], logprobs=[-0.1, -0.2, -0.3], mask=[1, 1, 1, 1]),
    ])
    # split-00000: more rows of b's group bp0/solver/0 in another shard
    register_raw_shard(root, "split", [row("bp0-extra", "bp0/solver/0", tokens=[5], logprobs=[-1.0], mask=[1])])
    # dup-00000: a sample id b already has, in a new group
    register_raw_shard(root, "dup", [row("bp1-rewriter-0-0", "dup/g", tokens=[5], logprobs=[-1.0], mask=[1])])
    # future-00000: a newer major schema
    register_raw_shard(root, "future", [row("f-0", "f/g", tokens=[5], logprobs=[-1.0], mask=[1])], "2.0")
    # b's manifest claims one row more than its shard holds
    doc = json.loads((root / "_manifests/b.json").read_text())
    doc["shards"][0]["rows"] += 1
    (root / "_manifests/b.json").write_text(json.dumps(doc))
    # an orphan (a crashed writer's renamed shard): a warning, not a problem
    shutil.copy(clean / "shards/b-00000.parquet", root / "shards/ghost-00000.parquet")
    return root


def test_clean_dataset_passes(clean):
    res = validate(clean)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "every check passed" in res.stdout and "3 shards" in res.stdout
    res = validate(clean, "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 0 and doc["ok"] and doc["num_problems"] == 0
    assert [s["path"] for s in doc["shards"]] == ["shards/a-00000.parquet", "shards/a-00001.parquet",
                                                  "shards/b-00000.parquet"]
    assert [s["rows"] for s in doc["shards"]] == [9, 9, 12] and doc["warnings"] == []


def test_each_damage_found_in_its_shard(broken):
    res = validate(broken, "--json")
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    checks = {s["path"].split("/")[1]: {p["check"] for p in s["problems"]} for s in doc["shards"]}
    assert "sha256" in checks["a-00000.parquet"]
    assert checks["a-00001.parquet"] == {"missing"}
    assert checks["raw-00000.parquet"] == {"invariant"}
    assert checks["future-00000.parquet"] == {"schema_version"}
    assert checks["b-00000.parquet"] == {"rows"}
    assert checks["split-00000.parquet"] == checks["dup-00000.parquet"] == set()

    shards = {s["path"].split("/")[1]: s for s in doc["shards"]}
    raw = [p["detail"] for p in shards["raw-00000.parquet"]["problems"]]
    assert raw == [
        "row group 0: sample 'raw-0': rollout_logprobs: token 2 has logprob 0.5 under loss_mask 1; "
        "engine logprobs must be finite and <= 0",
        "row group 1: sample 'raw-1': rollout_logprobs: length 3 and loss_mask length 4 must both equal "
        "response_tokens length 4; keep the engine's logprob of every response token",
    ]
    (future,) = shards["future-00000.parquet"]["problems"]
    assert "schema 2.0" in future["detail"] and "upgrade rollshard" in future["detail"]
    (rows,) = shards["b-00000.parquet"]["problems"]
    assert rows["detail"] == "the shard holds 12, the manifest says 13"

    by_check = {p["check"]: p for p in doc["dataset_problems"]}
    assert set(by_check) == {"split_group", "duplicate_sample_id"}
    assert by_check["split_group"]["shards"] == ["shards/b-00000.parquet", "shards/split-00000.parquet"]
    assert "'bp0/solver/0'" in by_check["split_group"]["detail"]
    assert by_check["duplicate_sample_id"]["shards"] == ["shards/b-00000.parquet", "shards/dup-00000.parquet"]
    assert "'bp1-rewriter-0-0' appears 2 times" in by_check["duplicate_sample_id"]["detail"]
    assert len(doc["warnings"]) == 1 and doc["warnings"][0].startswith("shards/ghost-00000.parquet: not in any")


def test_text_report_and_exit_status(broken):
    res = validate(broken, "--no-progress")
    assert res.returncode == 1
    for needle in ("sha256", "missing", "schema_version", "split_group", "duplicate_sample_id", "FAILED"):
        assert needle in res.stdout, needle


def test_progress_callback_and_reader_errors(clean, broken, tmp_path, capsys):
    seen = []
    report = validate_dataset(clean, on_shard=lambda r: seen.append(r.path))
    assert report.ok and len(seen) == 3
    # stats on a damaged dataset: one line pointing at validate, exit 1
    assert main(["stats", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rollshard-store validate" in err
    # a dataset of a newer major schema is refused by stats, with the version it needs
    register_raw_shard(tmp_path, "future", [row("f-0", "f/g", tokens=[5], logprobs=[-1.0], mask=[1])], "2.0")
    assert main(["stats", str(tmp_path)]) == 2
    assert "upgrade rollshard" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "nowhere")]) == 2
    assert "no rollshard dataset here" in capsys.readouterr().err


def test_a_manifest_xxh3_the_loader_would_refuse_is_found(clean, tmp_path):
    # The loader checks each block against the manifest's XXH3-128 where recorded: validate checks those hashes too,
    # so bytes that match their sha256 under an XXH3 that does not match them are reported, not passed.
    root = tmp_path / "ds"
    shutil.copytree(clean, root)
    doc = json.loads((root / "_manifests/b.json").read_text())
    (shard,) = doc["shards"]
    assert shard["footer_xxh3"] and all(rg["xxh3"] for rg in shard["row_groups"])  # recorded by the writer
    assert validate_dataset(root).ok
    shard["row_groups"][0]["xxh3"] = "0" * 32
    shard["footer_xxh3"] = "f" * 32
    (root / "_manifests/b.json").write_text(json.dumps(doc))
    (report,) = [s for s in validate_dataset(root).shards if s.path == "shards/b-00000.parquet"]
    assert [(p.check, p.detail) for p in report.problems] == [
        ("ranges", "row group 0: the manifest's xxh3 differs from the bytes its sha256 matches (1 row groups); "
                   "the loader would refuse them"),
        ("ranges", "footer: the manifest's footer_xxh3 differs from the bytes its footer_sha256 matches"),
    ]

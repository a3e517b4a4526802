"""Manifests may list only files under the dataset's shards/ folder: no reader follows one outside."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rollshard.store.commands import main
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.common import DataError
from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.store.format.manifest import check_shard_path
from rollshard.store.io.storage import Storage
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.validate import validate_dataset
from rollshard.store.io.writer import ShardWriter


@pytest.mark.parametrize("path", [
    "../outside/x.parquet",
    "shards/../../outside/x.parquet",
    "../../../../../../../../etc/passwd",
    "/etc/passwd",
    "x.parquet",  # in the root, not under shards/
    "_manifests/a.json",
    "shards/./x.parquet",
    "shards//x.parquet",
    "shards/",
    "shards\\..\\..\\x.parquet",
    "s3://bucket/shards/x.parquet",
    "C:/shards/x.parquet",
])
def test_paths_outside_shards_are_refused(path):
    with pytest.raises(DataError) as info:
        check_shard_path(path, "_manifests/w.json")
    assert str(info.value) == (
        f"_manifests/w.json: shard path {path!r} is not inside the dataset: a manifest may list only relative paths "
        "under shards/ (no '..', not absolute); fix or remove this manifest entry"
    )


@pytest.mark.parametrize("path", ["shards/w0-00000.parquet", "shards/host-1/w0-00000.parquet", "shards/a..b.parquet"])
def test_paths_under_shards_are_accepted(path):
    check_shard_path(path, "_manifests/w.json")


@pytest.fixture
def escaping(tmp_path) -> Path:
    """A dataset whose manifest points at a real, valid shard outside it (``../outside/x.parquet``)."""
    root = tmp_path / "ds"
    with ShardWriter(root, writer_id="w0") as w:
        w.write_groups(synthetic_table(8, 2, seed=1, prompt_len=(2, 4), response_len=(2, 6)))
    (tmp_path / "outside").mkdir()
    shutil.move(root / "shards/w0-00000.parquet", tmp_path / "outside/x.parquet")
    doc = json.loads((root / "_manifests/w0.json").read_text())
    doc["shards"][0]["path"] = "../outside/x.parquet"  # size and checksum still those of the file it names
    (root / "_manifests/w0.json").write_text(json.dumps(doc))
    assert Storage(root).sha256("../outside/x.parquet") == doc["shards"][0]["sha256"]
    return root


def test_readers_refuse_a_manifest_that_points_outside(escaping, capsys):
    manifest = Storage(escaping).path("_manifests/w0.json")
    message = (f"{manifest}: shard path '../outside/x.parquet' is not inside the dataset: a manifest may list only "
               "relative paths under shards/ (no '..', not absolute); fix or remove this manifest entry")
    with pytest.raises(DataError) as info:
        RolloutDataset.open(escaping)
    assert str(info.value) == message
    with pytest.raises(DataError) as info:
        RolloutLoader(escaping, LoaderConfig(groups_per_step=1))
    assert str(info.value) == message
    assert main(["stats", str(escaping)]) == 2
    assert capsys.readouterr().err == f"rollshard-store: error: {escaping}: {message}\n"

    # validate reports the manifest and reads nothing it lists
    report = validate_dataset(escaping)
    assert not report.ok and report.shards == []
    (problem,) = report.dataset_problems
    assert problem.check == "manifest" and "'../outside/x.parquet' is not inside the dataset" in problem.detail


def _remote_view(root: Path, torn_reads: int) -> tuple[Storage, list[int]]:
    """A local dataset read as an object store is: its manifest's first ``torn_reads`` reads come back cut short,
    as a HEAD-then-GET read does when the writer replaces the manifest between the two."""
    storage = Storage(root)
    storage.local = False
    reads = []
    whole = storage.read_bytes

    def read_bytes(rel):
        data = whole(rel)
        reads.append(len(data))
        return data[: len(data) // 2] if len(reads) <= torn_reads else data

    storage.read_bytes = read_bytes
    return storage, reads


def test_a_torn_read_of_a_remote_manifest_is_read_again(tmp_path):
    from rollshard.store.format.manifest import REMOTE_READ_ATTEMPTS, load_manifests

    root = tmp_path / "ds"
    with ShardWriter(root, writer_id="w0") as w:
        w.write_groups(synthetic_table(8, 2, seed=1, prompt_len=(2, 4), response_len=(2, 6)))
    storage, reads = _remote_view(root, torn_reads=2)
    (manifest,) = load_manifests(storage)
    assert manifest.writer_id == "w0" and len(reads) == 3 and sum(s.rows for s in manifest.shards) == 16
    # One that stays unreadable is refused, naming it, after the attempts.
    storage, reads = _remote_view(root, torn_reads=REMOTE_READ_ATTEMPTS)
    with pytest.raises(ValueError, match=r"_manifests/w0.json: unreadable manifest"):
        load_manifests(storage)
    assert len(reads) == REMOTE_READ_ATTEMPTS
    # A local manifest is replaced by rename: read once.
    storage, reads = _remote_view(root, torn_reads=1)
    storage.local = True
    with pytest.raises(ValueError, match="unreadable manifest"):
        load_manifests(storage)
    assert len(reads) == 1

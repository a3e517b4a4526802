"""Datasets on S3, against a real S3-protocol server on 127.0.0.1 (moto's): the commit protocol without rename."""

import json
import os
import socket
import subprocess
import sys

import boto3
import pyarrow.fs as pafs
import pytest

from rollshard.store.io import s3 as s3mod
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.format.manifest import Manifest
from rollshard.store.io.storage import Storage
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.validate import validate_dataset
from rollshard.store.io.writer import ShardWriter, WriterOptions
from tests import forked

pytestmark = pytest.mark.s3

SMALL = dict(prompt_len=(4, 8), response_len=(2, 6))


def _keys(uri: str) -> list[str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    out = []
    for page in boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"].removeprefix(prefix + "/") for o in page.get("Contents", [])]
    return sorted(out)


def _uploads(uri: str) -> list[str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return [u["Key"] for u in boto3.client("s3").list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])]


def _lease_key(uri: str, writer_id: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, f"{prefix}/_manifests/{writer_id}.lease"


def test_round_trip(s3_dataset):
    a, b = synthetic_table(3, 2, seed=1, **SMALL), synthetic_table(2, 2, seed=2, prefix="x", **SMALL)
    with ShardWriter(s3_dataset, writer_id="w0") as w:
        w.write_groups(a)
        w.commit()
        w.write_groups(b)
    ds = RolloutDataset.open(s3_dataset)
    assert [s.path for s in ds.shards] == ["shards/w0-00000.parquet", "shards/w0-00001.parquet"]
    assert ds.read().drop(["created_at"]).equals(pa_concat(a, b).drop(["created_at"]))
    assert ds.shards[0].sha256 == ds.storage.sha256(ds.shards[0].path)  # hashed on the way up
    assert _keys(s3_dataset) == ["_manifests/w0.json", "shards/w0-00000.parquet", "shards/w0-00001.parquet"]
    assert validate_dataset(s3_dataset).problems == []


def pa_concat(*tables):
    import pyarrow as pa

    return pa.concat_tables(tables)


def test_multipart_upload_is_created_once_and_aborts_to_nothing(s3_dataset, monkeypatch):
    monkeypatch.setattr(s3mod, "PART_BYTES", 5 << 20)  # S3's smallest part: three parts for 12 MiB
    storage = Storage(s3_dataset)
    data = os.urandom(12 << 20)
    up = s3mod.Upload(storage.bucket, storage.path("shards/x.parquet"))
    for i in range(0, len(data), 1 << 20):
        up.write(data[i:i + (1 << 20)])
    assert _keys(s3_dataset) == [] and _uploads(s3_dataset) == ["data/shards/x.parquet"]  # parts up, not visible
    up.complete()
    assert storage.read_bytes("shards/x.parquet") == data and _uploads(s3_dataset) == []
    again = s3mod.Upload(storage.bucket, storage.path("shards/x.parquet"))
    again.write(data[: 6 << 20])
    with pytest.raises(s3mod.PreconditionFailed, match="was written by someone else"):
        again.complete()
    assert storage.read_bytes("shards/x.parquet") == data and _uploads(s3_dataset) == []  # kept; aborted
    dropped = s3mod.Upload(storage.bucket, storage.path("shards/y.parquet"))
    dropped.write(data[: 6 << 20])
    dropped.abort()
    assert _keys(s3_dataset) == ["shards/x.parquet"] and _uploads(s3_dataset) == []


def test_a_crash_inside_abort_leaves_nothing_to_adopt(s3_dataset, monkeypatch):
    # The network fails while a shard is being discarded, as a crash there would: nothing of it may be adopted.
    monkeypatch.setattr(s3mod, "PART_BYTES", 1)  # every row group goes up as a part of a multipart upload
    table = synthetic_table(3, 2, seed=3, **SMALL)

    def lost(*args, **kwargs):
        raise ConnectionError("connection lost")

    with pytest.raises(ConnectionError):  # raised by the abort, over the interrupt
        with ShardWriter(s3_dataset, writer_id="w0", options=WriterOptions(row_group_bytes=1)) as w:
            w.write_groups(table)
            w.flush()
            monkeypatch.setattr(s3mod.Bucket, "abort_upload", lost)
            monkeypatch.setattr(Storage, "delete", lost)
            raise KeyboardInterrupt
    monkeypatch.undo()
    assert _keys(s3_dataset) == ["_manifests/w0.json"]  # nothing visible under shards/
    assert _uploads(s3_dataset) == ["data/shards/w0-00000.parquet"]  # the upload the lost abort left behind
    ShardWriter(s3_dataset, writer_id="w0").close()  # reopening aborts it and adopts nothing
    assert RolloutDataset.open(s3_dataset).shards == []
    assert _keys(s3_dataset) == ["_manifests/w0.json"] and _uploads(s3_dataset) == []


def test_crash_between_upload_and_manifest_is_adopted(s3_dataset, monkeypatch):
    table = synthetic_table(3, 2, seed=7, **SMALL)

    def crash(self):
        raise OSError("network vanished")

    with pytest.raises(OSError):
        with ShardWriter(s3_dataset, writer_id="w0") as w:
            monkeypatch.setattr(ShardWriter, "save_manifest", crash)
            w.write_groups(table)
    monkeypatch.undo()
    ShardWriter(s3_dataset, writer_id="w0").close()
    ds = RolloutDataset.open(s3_dataset)
    assert [(s.path, s.rows, s.groups) for s in ds.shards] == [("shards/w0-00000.parquet", 6, 3)]
    assert validate_dataset(s3_dataset).problems == []


def test_a_writer_id_is_leased(s3_dataset):
    with ShardWriter(s3_dataset, writer_id="w0"):
        with pytest.raises(s3mod.S3Error, match=rf"another process is writing into {s3_dataset} as writer 'w0' "
                           rf"\(pid {os.getpid()} on {socket.gethostname()}, its lease runs \d+ s more\); give each"):
            ShardWriter(s3_dataset, writer_id="w0")
        ShardWriter(s3_dataset, writer_id="w1").close()  # another id is free
    assert _keys(s3_dataset) == ["_manifests/w0.json", "_manifests/w1.json"]  # leases released
    ShardWriter(s3_dataset, writer_id="w0").close()


def _put_lease(uri, writer_id, **body):
    bucket, key = _lease_key(uri, writer_id)
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=json.dumps(body).encode())


def test_a_lease_of_a_dead_process_here_is_taken_at_once(s3_dataset):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = s3mod.process_identity(os.getpid())
    _put_lease(s3_dataset, "w0", **{**here, "pid": int(dead.stdout), "start": 1}, seconds=3600)
    with ShardWriter(s3_dataset, writer_id="w0") as w:
        assert w._claim.took_over
        w.write_groups(synthetic_table(1, 2, **SMALL))
    assert RolloutDataset.open(s3_dataset).num_groups == 1


def test_a_pid_now_of_another_process_is_not_the_holder(s3_dataset):
    # After a restart the pid may belong to a live process again (a container's pid 1): its start time differs.
    here = s3mod.process_identity(os.getpid())
    _put_lease(s3_dataset, "w0", **{**here, "start": here["start"] - 1}, seconds=3600)
    with ShardWriter(s3_dataset, writer_id="w0") as w:
        assert w._claim.took_over
    _put_lease(s3_dataset, "w0", **{**here, "pidns": here["pidns"] + 1}, seconds=3600)  # a container beside us
    with pytest.raises(s3mod.S3Error, match=r"its lease runs 3\d{3} s more"):
        ShardWriter(s3_dataset, writer_id="w0", options=WriterOptions(lease_wait_seconds=0))


def test_a_lease_from_another_host_holds_for_its_term(s3_dataset):
    _put_lease(s3_dataset, "w0", host="elsewhere", pid=1, seconds=3600)
    with pytest.raises(s3mod.S3Error, match=r"\(pid 1 on elsewhere, its lease runs 3\d{3} s more\)"):
        ShardWriter(s3_dataset, writer_id="w0", options=WriterOptions(lease_wait_seconds=0))
    _put_lease(s3_dataset, "w0", host="elsewhere", pid=1, seconds=0)  # its term is over (by the server's clock)
    ShardWriter(s3_dataset, writer_id="w0").close()


def test_a_lease_elsewhere_that_lapses_while_watched_is_taken(s3_dataset):
    # A Ray task rerun on another node: its dead predecessor's lease (2 s here) is watched until it lapses.
    _put_lease(s3_dataset, "w0", host="elsewhere", pid=1, seconds=2)
    with ShardWriter(s3_dataset, writer_id="w0") as w:
        assert w._claim.took_over
    with pytest.raises(ValueError, match="a lease term of 1 s is too short; give at least 10 s"):
        ShardWriter(s3_dataset, writer_id="w1", options=WriterOptions(lease_seconds=1))


def test_a_writer_that_lost_its_id_cannot_commit_over_the_new_holder(s3_dataset):
    """A paused writer (its lease expired) wakes up after another process took its id: the store stays whole."""
    a_rows, b_rows = synthetic_table(2, 2, seed=1, **SMALL), synthetic_table(2, 2, seed=2, prefix="b", **SMALL)
    a = ShardWriter(s3_dataset, writer_id="w0")
    a._claim.lease._stop.set()  # paused: no renewals from here on
    _put_lease(s3_dataset, "w0", host="elsewhere", pid=1, seconds=0)  # ... and the term ran out
    b = ShardWriter(s3_dataset, writer_id="w0")  # takes the id over, and rewrites the manifest at once
    assert b._claim.took_over
    a.write_groups(a_rows)
    with pytest.raises(s3mod.S3Error, match="the manifest of writer 'w0' .* was changed by another process since "
                       "this one opened it; this writer stopped"):
        a.commit()  # its shard went up (created once), its manifest entry is refused
    assert not a._claim.lease.renew()  # and the lease it had is gone
    a.abort()
    b.write_groups(b_rows)
    with pytest.raises(s3mod.S3Error, match="shards/w0-00000.parquet exists already"):
        b.commit()  # the key the paused writer took is never overwritten
    b.abort()
    with ShardWriter(s3_dataset, writer_id="w0") as w:  # the rerun adopts the paused writer's complete shard
        w.write_groups(b_rows)
    ds = RolloutDataset.open(s3_dataset)
    assert sorted(ds.read(columns=["sample_id"]).column(0).to_pylist()) == sorted(
        a_rows.column("sample_id").to_pylist() + b_rows.column("sample_id").to_pylist())
    assert validate_dataset(s3_dataset).problems == []


@pytest.mark.parametrize("ignored", ["put_object/IfNoneMatch", "put_object/IfMatch",
                                     "complete_multipart_upload/IfNoneMatch"])
def test_an_endpoint_ignoring_conditional_writes_is_refused(s3_dataset, monkeypatch, ignored):
    real_call = s3mod.Bucket.call
    op, header = ignored.split("/")

    def ignoring(self, name, path, **kwargs):
        if name == op:
            kwargs.pop(header, None)
        return real_call(self, name, path, **kwargs)

    monkeypatch.setattr(s3mod.Bucket, "call", ignoring)
    monkeypatch.setattr(s3mod.Bucket, "probed", set())
    with pytest.raises(s3mod.S3Error, match="ignores conditional writes .* use an endpoint that supports them"):
        ShardWriter(s3_dataset, writer_id="w0")
    monkeypatch.undo()
    ShardWriter(s3_dataset, writer_id="w0").close()  # the same bucket on an endpoint that honours them


def test_manifest_is_the_commit_point_for_readers(s3_dataset):
    # An object under shards/ that no manifest lists is not part of the dataset (and validate says so).
    with ShardWriter(s3_dataset, writer_id="w0") as w:
        w.write_groups(synthetic_table(2, 2, **SMALL))
    storage = Storage(s3_dataset)
    storage.fs.copy_file(storage.path("shards/w0-00000.parquet"), storage.path("shards/w9-00000.parquet"))
    assert RolloutDataset.open(s3_dataset).num_groups == 2
    report = validate_dataset(s3_dataset)
    assert report.problems == [] and any("w9-00000.parquet" in w for w in report.warnings)
    assert isinstance(storage.fs, pafs.S3FileSystem) and Manifest.load(storage, "w0").writer_id == "w0"


def test_every_reader_on_s3_equals_a_local_copy(s3_dataset, tmp_path):
    from tests.store.test_loader import SMALL as LOADER_SMALL, assert_steps_equal, cfg, run, write

    from rollshard.store.loader import hf_groups

    table = synthetic_table(20, 3, seed=4, uneven_groups=True, **LOADER_SMALL)
    remote, local = write(s3_dataset, table), write(tmp_path / "local", table)
    assert len(remote.shards) >= 2
    assert [(s.path, s.sha256) for s in remote.shards] == [(s.path, s.sha256) for s in local.shards]
    assert remote.scan().collect().equals(local.scan().collect())  # polars
    for streaming in (True, False):
        assert list(remote.to_hf(streaming=streaming)) == list(local.to_hf(streaming=streaming))
    assert list(hf_groups(remote, cfg())) == list(hf_groups(local, cfg()))
    for world_size in (1, 2):
        for rank in range(world_size):
            assert_steps_equal(run(remote, cfg(), rank, world_size), run(local, cfg(), rank, world_size))
    assert validate_dataset(s3_dataset).problems == []


def test_store_commands_on_s3(s3_dataset):
    with ShardWriter(s3_dataset, writer_id="w0") as w:
        w.write_groups(synthetic_table(3, 2, seed=5, **SMALL))
    sample = RolloutDataset.open(s3_dataset).read(columns=["sample_id"]).column(0)[0].as_py()

    def store(*args):
        r = forked.run("rollshard.store", *args, timeout=300, env={**os.environ, "COLUMNS": "200"})
        assert r.returncode == 0, r.stderr
        return r.stdout + r.stderr

    assert "ok: 1 shards, 6 rows, every check passed" in store("validate", s3_dataset)
    assert "│ policy │    6 │      3 │" in store("stats", s3_dataset)
    assert f"sample {sample}" in store("inspect", s3_dataset, "--sample", sample)


def test_writing_into_a_missing_bucket_is_one_line(s3_dataset):
    missing = s3_dataset.replace("s3://", "s3://no-such-").rsplit("/", 1)[0] + "/data"
    with pytest.raises(s3mod.S3Error, match=r"^s3://no-such-.*: put_object failed: .*NoSuchBucket.*; check the bucket"):
        ShardWriter(missing)
    with pytest.raises(ValueError, match=r"give S3 settings through the environment \(AWS_ENDPOINT_URL"):
        Storage(s3_dataset + "?endpoint_override=127.0.0.1:9")


@pytest.mark.parametrize("op", ["put_object", "complete_multipart_upload"])
def test_a_retried_write_that_had_landed_is_ours(s3_dataset, monkeypatch, op):
    # The server applied the write but its answer was lost; the client's retry then fails its own condition.
    monkeypatch.setattr(s3mod, "PART_BYTES", 5 << 20)
    real_call = s3mod.Bucket.call

    def answer_lost(self, name, path, **kwargs):
        if name == op and ("IfMatch" in kwargs or "IfNoneMatch" in kwargs):
            real_call(self, name, path, **kwargs)
            if name == "complete_multipart_upload":  # moto (like S3) accepts a repeated completion: refuse it
                raise s3mod.PreconditionFailed(f"s3://{path} was written by someone else")
        return real_call(self, name, path, **kwargs)

    big = synthetic_table(150, 4, seed=6)  # > 5 MiB: a multipart shard
    with ShardWriter(s3_dataset, writer_id="w0", options=WriterOptions(row_group_bytes=4 << 20)) as w:
        monkeypatch.setattr(s3mod.Bucket, "call", answer_lost)
        w.write_groups(big)
        w.commit()
    monkeypatch.undo()
    ds = RolloutDataset.open(s3_dataset)
    assert ds.num_groups == 150 and ds.shards[0].bytes > 5 << 20 and validate_dataset(s3_dataset).problems == []


def test_a_lease_deleted_under_its_holder_is_lost(s3_dataset, monkeypatch):
    w = ShardWriter(s3_dataset, writer_id="w0")
    boto3.client("s3").delete_object(Bucket=_lease_key(s3_dataset, "w0")[0], Key=_lease_key(s3_dataset, "w0")[1])
    assert not w._claim.lease.renew()
    with pytest.raises(s3mod.S3Error, match="the lease of writer 'w0' .* was deleted by another process; this writer "
                       "stopped"):
        w.commit()
    w.abort()


def test_releasing_a_lease_is_best_effort(s3_dataset, monkeypatch, caplog):
    w = ShardWriter(s3_dataset, writer_id="w0")
    w.write_groups(synthetic_table(2, 2, **SMALL))

    def down(self, path, *, match=None):
        raise s3mod.S3Error("endpoint down")

    monkeypatch.setattr(s3mod.Bucket, "delete", down)
    w.close()  # committed; the lease is left to lapse
    assert RolloutDataset.open(s3_dataset).num_groups == 2 and "could not release" in caplog.text
    assert isinstance(s3mod.S3Error("x"), OSError)  # commands report it in one line


def test_a_given_s3_filesystem_reads_by_uri_and_refuses_writes(s3_dataset):
    with ShardWriter(s3_dataset, writer_id="w0") as w:
        w.write_groups(synthetic_table(2, 2, **SMALL))
    storage = Storage(s3_dataset)
    given = Storage(storage.root, filesystem=storage.fs)
    assert given.uri == s3_dataset and given.s3
    assert len(list(RolloutDataset.open(given).to_hf())) == 4
    with pytest.raises(s3mod.S3Error, match="writing through a given S3FileSystem is not supported; pass the s3:// URI"):
        ShardWriter(given, writer_id="w1")


def test_filter_from_s3_into_s3_and_one_derive_at_a_time(s3_dataset):
    from rollshard.store.derived.derive import DeriveError, DeriveLock
    from rollshard.store.derived.filter import RowFilter, filter_dataset

    table = synthetic_table(4, 2, seed=8, **SMALL)
    with ShardWriter(s3_dataset, writer_id="w0") as w:
        w.write_groups(table)
    out = s3_dataset.rsplit("/", 1)[0] + "/kept"
    keep = frozenset(table.column("sample_id").to_pylist()[:4])  # groups 0 and 1
    with DeriveLock(Storage(out)):
        with pytest.raises(DeriveError, match="another process is deriving into .*kept; wait for it to finish"):
            filter_dataset(s3_dataset, out, RowFilter(sample_ids=keep), progress=False)
    filter_dataset(s3_dataset, out, RowFilter(sample_ids=keep), progress=False)
    assert sorted(RolloutDataset.open(out).read(columns=["sample_id"]).column(0).to_pylist()) == sorted(keep)
    assert validate_dataset(out).problems == []

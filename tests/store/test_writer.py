import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.format.schema import RowInvariantError, SchemaVersionError
from rollshard.store.io.storage import Storage
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.validate import validate_dataset
from rollshard.store.io.writer import ShardWriter, WriterOptions

SMALL = dict(prompt_len=(3, 9), response_len=(2, 30))


def groups_of(table: pa.Table) -> list[pa.Table]:
    ids = table.column("group_id").to_pylist()
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            out.append(table.slice(start, i - start))
            start = i
    return out


def test_write_commit_and_manifest_counts(tmp_path):
    table = synthetic_table(6, 3, seed=1, **SMALL)
    with ShardWriter(tmp_path, writer_id="w0", config={"task": "toy"}) as w:
        for g in groups_of(table):
            w.write_group(g)
    ds = RolloutDataset.open(tmp_path)
    assert [s.path for s in ds.shards] == ["shards/w0-00000.parquet"]
    shard = ds.shards[0]
    assert (shard.rows, shard.groups) == (18, 6)
    assert shard.response_tokens == pc.sum(pc.list_value_length(table["response_tokens"])).as_py()
    assert shard.prompt_tokens == pc.sum(pc.list_value_length(table["prompt_tokens"])).as_py()
    assert shard.bytes == os.path.getsize(tmp_path / shard.path)
    assert shard.sha256 == Storage(tmp_path).sha256(shard.path)
    assert ds.config == {"task": "toy"}
    meta = pq.read_schema(tmp_path / shard.path).metadata
    assert meta[b"rollshard.schema_version"] == b"1.2"
    assert json.loads(meta[b"rollshard.config"]) == {"task": "toy"}
    assert ds.read().equals(table)


def test_row_group_per_flush_and_shard_roll_over_keeps_groups_whole(tmp_path):
    table = synthetic_table(40, 4, seed=2, uneven_groups=True, **SMALL)
    opts = WriterOptions(row_group_bytes=4_000, shard_bytes=8_000)
    with ShardWriter(tmp_path, writer_id="w0", options=opts) as w:
        for g in groups_of(table):
            w.write_group(g)
    ds = RolloutDataset.open(tmp_path)
    assert len(ds.shards) > 2
    owner: dict[str, str] = {}
    for s in ds.shards:
        pf = pq.ParquetFile(tmp_path / s.path)
        assert pf.metadata.num_row_groups >= 1
        for gid in set(pf.read(columns=["group_id"]).column("group_id").to_pylist()):
            assert owner.setdefault(gid, s.path) == s.path, f"group {gid} split across shards"
    assert ds.num_rows == table.num_rows
    assert sorted(ds.read()["sample_id"].to_pylist()) == sorted(table["sample_id"].to_pylist())


def test_write_group_refuses_dropped_logprobs_naming_the_sample(tmp_path):
    # The seed's bug: the engine returned logprobs, the rows kept only the token ids.
    table = synthetic_table(1, 2, seed=3, **SMALL)
    lp = table["rollout_logprobs"].to_pylist()
    lp[1] = []
    bad = table.set_column(table.schema.get_field_index("rollout_logprobs"), "rollout_logprobs", pa.array(lp, pa.list_(pa.float32())))
    with ShardWriter(tmp_path, writer_id="w0") as w:
        with pytest.raises(RowInvariantError) as err:
            w.write_group(bad)
    n = len(table["response_tokens"][1])
    assert str(err.value) == (
        f"sample 'p0-policy-0-1': rollout_logprobs: length 0 and loss_mask length {n} must both equal "
        f"response_tokens length {n}; keep the engine's logprob of every response token"
    )
    assert RolloutDataset.open(tmp_path).num_rows == 0


def test_write_group_takes_exactly_one_group(tmp_path):
    with ShardWriter(tmp_path, writer_id="w0") as w:
        with pytest.raises(ValueError, match="rows of one group"):
            w.write_group(synthetic_table(2, 2, **SMALL))


def test_exception_in_with_block_leaves_no_visible_shard(tmp_path):
    table = synthetic_table(4, 2, seed=4, **SMALL)
    with pytest.raises(KeyboardInterrupt):
        with ShardWriter(tmp_path, writer_id="w0", options=WriterOptions(row_group_bytes=1)) as w:
            w.write_groups(table)  # flushed to a temporary file, not committed
            raise KeyboardInterrupt
    assert os.listdir(tmp_path / "shards") == []
    assert os.listdir(tmp_path / "_tmp") == []
    assert RolloutDataset.open(tmp_path).shards == []


def test_same_writer_id_is_locked(tmp_path):
    with ShardWriter(tmp_path, writer_id="w0"):
        with pytest.raises(RuntimeError, match="another process is writing .* as writer 'w0'; give each process its own writer id"):
            ShardWriter(tmp_path, writer_id="w0")
    ShardWriter(tmp_path, writer_id="w0").close()  # released


def test_reopened_writer_continues_its_manifest(tmp_path):
    a, b = synthetic_table(2, 2, seed=5, **SMALL), synthetic_table(2, 2, seed=6, prefix="x", **SMALL)
    with ShardWriter(tmp_path, writer_id="w0") as w:
        w.write_groups(a)
    with ShardWriter(tmp_path, writer_id="w0") as w:
        w.write_groups(b)
    ds = RolloutDataset.open(tmp_path)
    assert [s.path for s in ds.shards] == ["shards/w0-00000.parquet", "shards/w0-00001.parquet"]
    assert ds.num_rows == 8


def test_crash_between_rename_and_manifest_is_adopted(tmp_path, monkeypatch):
    table = synthetic_table(3, 2, seed=7, **SMALL)

    def crash(self):
        raise OSError("disk vanished")

    with pytest.raises(OSError):
        with ShardWriter(tmp_path, writer_id="w0") as w:
            monkeypatch.setattr(ShardWriter, "save_manifest", crash)
            w.write_groups(table)
    monkeypatch.undo()
    assert os.listdir(tmp_path / "shards") == ["w0-00000.parquet"]  # renamed, not in a manifest
    ShardWriter(tmp_path, writer_id="w0").close()
    ds = RolloutDataset.open(tmp_path)
    assert [(s.path, s.rows, s.groups) for s in ds.shards] == [("shards/w0-00000.parquet", 6, 3)]
    assert ds.read().equals(table)


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from rollshard.store.synthetic import synthetic_table
    from rollshard.store.io.writer import ShardWriter, WriterOptions
    path, writer_id, seed, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    table = synthetic_table(30, 3, seed=seed, prefix=writer_id, prompt_len=(3, 9), response_len=(2, 30))
    w = ShardWriter(path, writer_id=writer_id, options=WriterOptions(row_group_bytes=2_000, shard_bytes=1 << 40))
    w.write_groups(table.slice(0, 45))
    w.commit()
    w.write_groups(table.slice(45))  # several row groups flushed into the next shard's temporary file
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    w.close()
    """
)


def run_child(path, writer_id, seed, mode):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(path), writer_id, str(seed), mode])


def test_killed_writer_leaves_no_partial_shard_and_a_consistent_manifest(tmp_path):
    proc = run_child(tmp_path, "w0", 8, "kill")
    assert proc.wait(timeout=120) == -signal.SIGKILL
    assert len(os.listdir(tmp_path / "_tmp")) == 1  # the partial shard, invisible
    assert os.listdir(tmp_path / "shards") == ["w0-00000.parquet"]
    ds = RolloutDataset.open(tmp_path)
    assert ds.num_rows == 45
    assert ds.read()["sample_id"].to_pylist() == synthetic_table(30, 3, seed=8, prefix="w0", **SMALL)["sample_id"].to_pylist()[:45]
    # A standard reader pointed at the directory sees only the committed shard.
    import pyarrow.dataset as pads

    assert pads.dataset(tmp_path / "shards", format="parquet").count_rows() == 45
    ShardWriter(tmp_path, writer_id="w0").close()  # a restarted writer clears its own garbage
    assert os.listdir(tmp_path / "_tmp") == []


def test_two_writer_processes_into_one_dataset(tmp_path):
    procs = [run_child(tmp_path, f"host{i}", 10 + i, "close") for i in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    ds = RolloutDataset.open(tmp_path)
    assert sorted(m.writer_id for m in ds.manifests) == ["host0", "host1"]
    assert ds.num_rows == 180 and len(ds.shards) == 4
    ids = ds.read(columns=["sample_id"])["sample_id"].to_pylist()
    assert len(set(ids)) == 180


def test_newer_schema_major_is_refused(tmp_path):
    with ShardWriter(tmp_path, writer_id="w0") as w:
        w.write_groups(synthetic_table(1, 2, **SMALL))
    path = tmp_path / RolloutDataset.open(tmp_path).shards[0].path
    t = pq.read_table(path)
    pq.write_table(t.replace_schema_metadata({b"rollshard.schema_version": b"2.0"}), path)
    with pytest.raises(SchemaVersionError, match="schema 2.0, this rollshard reads schema 1.x; upgrade rollshard"):
        RolloutDataset.open(tmp_path)


def test_remote_filesystem_path_writes_directly(tmp_path):
    # Any non-local pyarrow filesystem takes the object-store path (upload visible on close).
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    storage = Storage("data", filesystem=fs)
    assert not storage.local
    table = synthetic_table(3, 2, seed=9, **SMALL)
    with ShardWriter(storage, writer_id="w0") as w:
        w.write_groups(table)
    ds = RolloutDataset.open(Storage("data", filesystem=fs))
    assert ds.read().equals(table)
    assert ds.shards[0].sha256 == Storage(tmp_path / "data").sha256(ds.shards[0].path)


def test_bad_writer_id():
    with pytest.raises(ValueError, match="writer id 'a/b' must be"):
        ShardWriter("/nonexistent-never-created", writer_id="a/b")


def test_a_group_written_twice_is_refused(tmp_path):
    # Two calls with one group id would put the group in two shards once a commit falls between them.
    t = synthetic_table(2, 2, seed=12, **SMALL)
    with ShardWriter(tmp_path, writer_id="w0") as w:
        w.write_group(t.slice(0, 2))
        w.commit()
        with pytest.raises(ValueError, match="group 'p0/policy/0' was already written by writer 'w0'; a GRPO group must be written whole"):
            w.write_group(t.slice(0, 1))
        w.write_group(t.slice(2, 2))
    assert RolloutDataset.open(tmp_path).num_groups == 2


INJECTION_POINTS = 80  # interrupt points spread over the hand-off; measured: 7 of 60 hung before the fix


def _interrupted_commit(root, groups, at_line: int) -> tuple[str | None, int]:
    """Commit ``groups`` with a KeyboardInterrupt raised into the writing thread at its ``at_line``-th traced line
    (in the writer, the storage layer and the stdlib queue code it uses); the ``with`` block then
    discards the open shard as it would on a real Ctrl-C. Returns where it landed (None: not reached) and the
    number of lines traced."""
    # Not threading.py: CPython's threading is not safe against an exception raised inside it (an interrupt landing
    # in Thread.start's bookkeeping left a thread that never ran, and the next executor's join hung the test run).
    traced = ("store/io/writer.py", "store/io/storage.py", "/queue.py")
    main = threading.main_thread()
    seen = {"n": 0, "where": None}

    def local(frame, event, arg):
        if event == "line":
            seen["n"] += 1
            if seen["n"] == at_line:
                seen["where"] = f"{frame.f_code.co_filename}:{frame.f_lineno}"
                raise KeyboardInterrupt(seen["where"])
        return local

    def trace(frame, event, arg):
        return local if threading.current_thread() is main and frame.f_code.co_filename.endswith(traced) else None

    try:
        with ShardWriter(root, writer_id="w", options=WriterOptions(row_group_bytes=1)) as w:
            for g in groups[:2]:
                w.write_group(g)
            w.commit()  # committed before the interrupt: must survive it
            sys.settrace(trace)
            try:
                for g in groups[2:]:
                    w.write_group(g)
                w.commit()
            finally:
                sys.settrace(None)
    except KeyboardInterrupt:
        pass
    return seen["where"], seen["n"]


@pytest.mark.timeout(300)  # a hang (the failure this test exists for) fails here instead of blocking the run
def test_keyboard_interrupt_anywhere_in_a_commit_never_hangs_or_half_writes(tmp_path):
    groups = groups_of(synthetic_table(4, 3, seed=7, **SMALL))
    _, total = _interrupted_commit(tmp_path / "count", groups, at_line=0)  # no interrupt: count the lines
    landed = set()
    for i, at in enumerate(range(1, total + 1, max(1, total // INJECTION_POINTS))):
        root = tmp_path / f"ds{i}"
        where, _ = _interrupted_commit(root, groups, at)  # None: this run took fewer lines (polls vary)
        landed.add(str(where).rsplit(":", 1)[0].rsplit("/", 1)[-1])
        rows = RolloutDataset.open(root).read().num_rows
        assert rows in (6, 12), (where, rows)  # the first commit, or both: never part of one
        assert validate_dataset(root).problems == [], where
        # The writer id is free again; reopening cleans the temp files and adopts a shard renamed before the
        # interrupt but not yet in the manifest (it was complete: fsynced before the rename).
        with ShardWriter(root, writer_id="w"):
            pass
        assert not list((root / "_tmp").iterdir()) and not list((root / "_manifests").glob(".*.tmp")), where
        assert RolloutDataset.open(root).read().num_rows in (rows, 12) and validate_dataset(root).problems == []
    assert {"writer.py", "storage.py"} <= landed  # queue.py too, before SimpleQueue


def test_manifest_temp_file_of_a_crash_is_cleaned_on_reopen(tmp_path, monkeypatch):
    with ShardWriter(tmp_path, writer_id="w") as w:
        w.write_group(groups_of(synthetic_table(1, 2, seed=3, **SMALL))[0])
    # A crash between the manifest's write and its rename leaves its temp file behind.
    crashed = tmp_path / "_manifests" / f".w.json.{'0123abcd' * 4}.tmp"
    crashed.write_bytes(b'{"half": ')
    # Other writers' temp files are not ours to delete, also when their id extends ours ("w.json.x").
    others = [tmp_path / "_manifests" / f".v.json.{'0123abcd' * 4}.tmp",
              tmp_path / "_manifests" / f".w.json.x.json.{'0123abcd' * 4}.tmp"]
    for other in others:
        other.write_bytes(b"{}")
    with ShardWriter(tmp_path, writer_id="w") as w:
        assert len(w.committed_shards) == 1
    assert not crashed.exists() and all(other.exists() for other in others)


def test_discarding_a_shard_whose_io_thread_is_gone_does_not_raise(tmp_path):
    """An interrupt can tear the hand-off to the I/O thread in any state (the thread stopped with a buffer still
    counted as queued, say). Discarding the shard must then still drop it, not raise an I/O error of its own."""
    from rollshard.store.io.storage import PendingFile, Storage

    pending = PendingFile(Storage(tmp_path), "shards/x.parquet")
    pending.file.write(b"abc")
    pending.file._closing = True  # the I/O thread finishes the queue and stops
    pending.file._thread.join(30)
    pending.file._sent += 1  # a buffer that never reached it
    with pytest.raises(OSError, match="I/O thread stopped"):
        pending.file.flush()  # a commit would refuse it
    pending.discard()
    assert not list((tmp_path / "_tmp").iterdir()) and not (tmp_path / "shards" / "x.parquet").exists()


def _corruptions():
    """(name, change of one row's dict) for every invariant the writer checks."""
    return [
        ("logprob above 0", lambda d: d["rollout_logprobs"].__setitem__(0, 0.25)),
        ("logprob NaN", lambda d: d["rollout_logprobs"].__setitem__(-1, float("nan"))),
        ("logprob -inf", lambda d: d["rollout_logprobs"].__setitem__(1, float("-inf"))),
        ("logprob under mask 0", lambda d: (d["loss_mask"].__setitem__(0, 0), d["rollout_logprobs"].__setitem__(0, -0.5))),
        ("mask 2", lambda d: d["loss_mask"].__setitem__(1, 2)),
        ("dropped logprob", lambda d: d["rollout_logprobs"].pop()),
        ("dropped mask", lambda d: d["loss_mask"].pop()),
        ("empty sample_id", lambda d: d.__setitem__("sample_id", "")),
        ("empty group_id", lambda d: d.__setitem__("group_id", "")),
        ("empty prompt_id", lambda d: d.__setitem__("prompt_id", "")),
        ("empty agent", lambda d: d.__setitem__("agent", "")),
        ("negative response id", lambda d: d["response_tokens"].__setitem__(0, -3)),
        ("negative prompt id", lambda d: d["prompt_tokens"].__setitem__(-1, -1)),
        ("bad status", lambda d: d.__setitem__("status", "done")),
        ("NaN reward", lambda d: d.__setitem__("reward", float("nan"))),
        ("no reward", lambda d: d.__setitem__("reward", None)),
        ("no temperature", lambda d: d.__setitem__("temperature", None)),
        ("negative temperature", lambda d: d.__setitem__("temperature", -1.0)),
        ("infinite temperature", lambda d: d.__setitem__("temperature", float("inf"))),
        ("support alone", lambda d: d.__setitem__("sampling_support", [[t] for t in d["response_tokens"]])),
        ("support without its token", lambda d: (
            d.__setitem__("sampling_support", [[t + 1] for t in d["response_tokens"]]),
            d.__setitem__("sampling_logprobs", [0.0] * len(d["response_tokens"])))),
    ]


@pytest.mark.parametrize("name,change", _corruptions(), ids=[n for n, _ in _corruptions()])
def test_the_fast_screen_never_passes_a_row_the_full_check_refuses(tmp_path, name, change):
    """check_table's screen (is_clean) passes only tables in which find_problems finds nothing; the writer then refuses
    the group at its call, naming the sample, whether the group is fresh or a slice of a larger table."""
    from rollshard.store.format.invariants import check_table, find_problems, is_clean
    from rollshard.store.format.schema import ROW_SCHEMA
    table = synthetic_table(3, 4, seed=7, **SMALL)
    assert is_clean(table, frozenset(ROW_SCHEMA.names)) and find_problems(table, 20, set(ROW_SCHEMA.names)) == []
    rows = table.to_pylist()
    change(rows[5])
    bad = pa.Table.from_pylist(rows, schema=ROW_SCHEMA)
    problems = find_problems(bad, 20, set(ROW_SCHEMA.names))
    assert problems, name  # every corruption here breaks an invariant
    assert not is_clean(bad, frozenset(ROW_SCHEMA.names))
    assert check_table(bad) == problems
    for group in (bad.slice(4, 4), pa.Table.from_pylist(rows[4:8], schema=ROW_SCHEMA)):
        with ShardWriter(tmp_path / name, writer_id="w0") as w:
            w.write_groups(bad.slice(0, 4))
            with pytest.raises(RowInvariantError, match=f"sample {rows[5]['sample_id']!r}: {problems[0].field}"):
                w.write_groups(group)


def test_the_fast_screen_passes_clean_slices_and_projections():
    from rollshard.store.format.invariants import check_projection, is_clean
    from rollshard.store.format.schema import ROW_SCHEMA
    table = synthetic_table(4, 3, seed=2, **SMALL)
    for start, n in ((0, 12), (3, 3), (5, 4), (11, 1), (6, 0)):
        assert is_clean(table.slice(start, n), frozenset(ROW_SCHEMA.names))
    cols = ["sample_id", "response_tokens", "rollout_logprobs", "loss_mask", "temperature"]
    assert is_clean(table.select(cols), frozenset(cols))
    assert check_projection(table.select(cols)) == []

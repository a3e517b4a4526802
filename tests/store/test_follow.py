"""FollowLoader: steps from a dataset while it is written, in commit order, never before a commit; exact resume."""

import queue
import threading

import numpy as np
import pyarrow as pa
import pytest

from rollshard.store.common import DataError
from rollshard.store.io.live import mark_complete
from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.store.loader.filters import oldest_versions
from rollshard.store.loader.follow import FollowLoader, FollowTimeoutError
from rollshard.store.io.storage import Storage
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter

SMALL = dict(prompt_len=(2, 6), response_len=(1, 12))


def group_tables(n: int, prefix: str, seed: int = 0) -> list[pa.Table]:
    t = synthetic_table(n, 3, seed=seed, prefix=prefix, **SMALL)
    ids = t.column("group_id").to_pylist()
    return [t.filter(pa.array([g == gid for g in ids])) for gid in dict.fromkeys(ids)]


def commit(writer: ShardWriter, groups: list[pa.Table]) -> list[str]:
    for g in groups:
        writer.write_group(g)
    writer.commit()
    return [g.column("group_id")[0].as_py() for g in groups]


def cfg(**kw) -> LoaderConfig:
    return LoaderConfig(**{"groups_per_step": 2, "micro_batch_tokens": 512, **kw})


def consume(loader: FollowLoader, out: queue.Queue) -> threading.Thread:
    """Iterate ``loader`` on a thread: each step's group ids into ``out``, then None (or the exception)."""

    def run():
        try:
            for step in loader:
                out.put(step.group_ids)
            out.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out.put(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_polls(loader: FollowLoader, n: int) -> None:
    """Until the loader read the manifests ``n`` more times and found nothing it could use (a gate, not a sleep)."""
    target = loader.polls + n
    while loader.polls < target:
        threading.Event().wait(0.01)


def test_steps_come_in_commit_order_and_never_before_their_commit(tmp_path):
    groups = group_tables(7, "a")
    loader = FollowLoader(tmp_path, cfg(), poll_s=0.01, wait_s=60)
    out: queue.Queue = queue.Queue()
    with ShardWriter(tmp_path, writer_id="w0") as w:
        consume(loader, out)
        wait_polls(loader, 3)  # nothing committed yet: no step
        assert out.empty()
        first = commit(w, groups[:3])  # 3 groups: one step, one group left over
        assert out.get(timeout=60) == first[:2]
        wait_polls(loader, 3)  # the third group waits for a fourth
        assert out.empty()
        second = commit(w, groups[3:7])
        assert out.get(timeout=60) == [first[2], second[0]]
        assert out.get(timeout=60) == second[1:3]
        wait_polls(loader, 3)
        assert out.empty()
    mark_complete(Storage(tmp_path), "w0")
    assert out.get(timeout=60) is None  # complete: the last group (short of a step) is dropped
    assert loader.epoch_stats["tail_dropped_groups"] == 1
    assert loader.epoch_stats["groups_examined"] == 1


def test_two_writers_interleave_by_commit_time_and_the_tail_can_train(tmp_path):
    a, b = group_tables(3, "a", 1), group_tables(2, "b", 2)
    order = []
    with ShardWriter(tmp_path, writer_id="wa") as wa, ShardWriter(tmp_path, writer_id="wb") as wb:
        order += commit(wa, a[:2])
        order += commit(wb, b[:1])
        order += commit(wa, a[2:])
        order += commit(wb, b[1:])
    for writer in ("wa", "wb"):
        mark_complete(Storage(tmp_path), writer)
    steps = [s.group_ids for s in FollowLoader(tmp_path, cfg(tail="partial"), poll_s=0.01)]
    assert steps == [order[0:2], order[2:4], order[4:5]]


def test_resume_is_exact_mid_shard(tmp_path):
    groups = group_tables(9, "r")
    with ShardWriter(tmp_path, writer_id="w0") as w:
        commit(w, groups[:5])
        commit(w, groups[5:])
    mark_complete(Storage(tmp_path), "w0")
    whole = [s.group_ids for s in FollowLoader(tmp_path, cfg(), poll_s=0.01)]
    assert len(whole) == 4
    first = FollowLoader(tmp_path, cfg(), poll_s=0.01)
    it = iter(first)
    taken = [next(it).group_ids for _ in range(2)]  # 4 groups: the cursor is inside the first shard
    state = first.state_dict()
    assert state["shard_in_use"] is not None and state["next_group"] == 4 and state["used_shards"] == []
    again = FollowLoader(tmp_path, cfg(), poll_s=0.01)
    again.load_state_dict(state)
    assert taken + [s.group_ids for s in again] == whole


def test_a_wait_without_commits_ends_in_one_line(tmp_path):
    with ShardWriter(tmp_path, writer_id="w0") as w:
        commit(w, group_tables(1, "t"))
    loader = FollowLoader(tmp_path, cfg(), poll_s=0.01, wait_s=0.2)
    with pytest.raises(FollowTimeoutError, match=r"no new commit for 0 s while following it; is its generator running"):
        list(loader)


def test_stop_waiting_ends_the_iteration(tmp_path):
    loader = FollowLoader(tmp_path, cfg(), poll_s=0.01, wait_s=60)
    out: queue.Queue = queue.Queue()
    consume(loader, out)
    wait_polls(loader, 2)
    loader.stop_waiting()
    assert out.get(timeout=60) is None


def test_a_damaged_shard_stops_before_any_row_of_it(tmp_path):
    with ShardWriter(tmp_path, writer_id="w0") as w:
        commit(w, group_tables(2, "d"))
        (shard,) = [s.path for s in w.committed_shards]
    path = tmp_path / shard
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"{shard}: its bytes do not match the manifest's sha256"):
        list(FollowLoader(tmp_path, cfg(), poll_s=0.01))


def test_the_oldest_span_sets_a_rows_staleness(tmp_path):
    spans = pa.array(
        [
            [{"version": "5", "start": 0, "end": 4}],
            [{"version": "3", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 4}],  # continued across
            [],
            None,
            [{"version": "4", "start": 0, "end": 1}],
        ],
        pa.list_(pa.struct([("version", pa.string()), ("start", pa.int32()), ("end", pa.int32())])),
    )
    small = pa.table({"weight_version": ["5", "5", "2", None, "4"], "weight_versions": spans})
    none = np.iinfo(np.int64).min
    assert oldest_versions(small).tolist() == [5, 3, 2, none, 4]
    # The loaders drop the continued row at current version 6, max_staleness 2 (oldest 3 < 4), keep the others.
    t = synthetic_table(2, 2, seed=3, weight_versions=("5",), **SMALL)
    v = t.column("weight_versions").to_pylist()
    n = len(t.column("response_tokens")[0])
    v[0] = [{"version": "3", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": n}]
    t = t.set_column(t.schema.get_field_index("weight_versions"), "weight_versions", pa.array(v, spans.type))
    with ShardWriter(tmp_path, writer_id="w0") as w:
        for g in group_tables_of(t):
            w.write_group(g)
    mark_complete(Storage(tmp_path), "w0")
    for loader in (RolloutLoader(tmp_path, cfg(max_staleness=2, current_version="6", shuffle=False)),
                   FollowLoader(tmp_path, cfg(max_staleness=2, current_version="6"), poll_s=0.01)):
        (step,) = list(loader)
        assert step.metrics["filtered_rows/stale"] == 1
        assert t.column("sample_id")[0].as_py() not in step.micro_batches[0].sample_ids


def group_tables_of(t: pa.Table) -> list[pa.Table]:
    ids = t.column("group_id").to_pylist()
    return [t.filter(pa.array([g == gid for g in ids])) for gid in dict.fromkeys(ids)]


def test_it_follows_a_dataset_on_s3(s3_dataset):
    groups = group_tables(5, "s")
    loader = FollowLoader(s3_dataset, cfg(), poll_s=0.01, wait_s=60)
    out: queue.Queue = queue.Queue()
    with ShardWriter(s3_dataset, writer_id="w0") as w:
        consume(loader, out)
        first = commit(w, groups[:3])
        assert out.get(timeout=60) == first[:2]
        wait_polls(loader, 2)
        assert out.empty()
        second = commit(w, groups[3:])
        assert out.get(timeout=60) == [first[2], second[0]]
    mark_complete(Storage(s3_dataset), "w0")
    assert out.get(timeout=60) is None
    assert loader.epoch_stats["tail_dropped_groups"] == 1
    again = FollowLoader(s3_dataset, cfg(tail="partial"), poll_s=0.01)
    assert [s.group_ids for s in again] == [first[:2], [first[2], second[0]], second[1:]]


def test_a_stop_mid_step_leaves_the_groups_read_for_it_to_the_resume(tmp_path):
    groups = group_tables(3, "m")
    loader = FollowLoader(tmp_path, cfg(), poll_s=0.01, wait_s=60)
    out: queue.Queue = queue.Queue()
    with ShardWriter(tmp_path, writer_id="w0") as w:
        ids = commit(w, groups)
    consume(loader, out)
    assert out.get(timeout=60) == ids[:2]
    wait_polls(loader, 2)  # the third group is read and waits for a fourth
    loader.stop_waiting()
    assert out.get(timeout=60) is None
    state = loader.state_dict()
    assert state["next_group"] == 2 and state["steps"] == 1  # the third group not taken
    mark_complete(Storage(tmp_path), "w0")
    again = FollowLoader(tmp_path, cfg(tail="partial"), poll_s=0.01)
    again.load_state_dict(state)
    assert [s.group_ids for s in again] == [ids[2:]]
    assert [s.group_ids for s in loader] == []  # the same loader, iterated again: the third dropped as the tail
    assert loader.epoch_stats["tail_dropped_groups"] == 1

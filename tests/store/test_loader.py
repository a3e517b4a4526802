import collections
import dataclasses
import json
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.loader import LoaderConfig, LoaderStateError, RolloutLoader, Step, hf_groups
from rollshard.store.loader import stream as stream_mod
from rollshard.store.loader.packing import unpack
from rollshard.store.io.storage import Storage
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter, WriterOptions

SMALL = dict(prompt_len=(2, 6), response_len=(1, 12))
# a few groups per row group, a few row groups per shard: windows and steps straddle both
SMALL_FILES = WriterOptions(row_group_bytes=2_500, shard_bytes=7_000)


def groups_of(table: pa.Table) -> list[pa.Table]:
    ids = table.column("group_id").to_pylist()
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            out.append(table.slice(start, i - start))
            start = i
    return out


def write(path, table: pa.Table, writer_id: str = "w0", options: WriterOptions = SMALL_FILES) -> RolloutDataset:
    with ShardWriter(path, writer_id=writer_id, options=options) as w:
        for g in groups_of(table):
            w.write_group(g)
    return RolloutDataset.open(path)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> RolloutDataset:
    """60 groups of 1-5 rows over two writers, several shards and row groups each."""
    path = tmp_path_factory.mktemp("ds")
    write(path, synthetic_table(35, 3, seed=1, uneven_groups=True, prefix="a", **SMALL), "w0")
    ds = write(path, synthetic_table(25, 3, seed=2, uneven_groups=True, prefix="b", **SMALL), "w1")
    assert len(ds.shards) >= 4 and ds.num_groups == 60
    return ds


def cfg(**kw) -> LoaderConfig:
    base = dict(groups_per_step=2, micro_batch_tokens=24, shuffle_window=5, prefetch=2)
    return LoaderConfig(**{**base, **kw})


def run(ds, config: LoaderConfig, rank: int = 0, world_size: int = 1, state: dict | None = None) -> list[Step]:
    with RolloutLoader(ds, config, rank=rank, world_size=world_size) as loader:
        if state is not None:
            loader.load_state_dict(state)
        return list(loader)


def assert_steps_equal(a: list[Step], b: list[Step]) -> None:
    assert [(s.epoch, s.index, s.group_ids) for s in a] == [(s.epoch, s.index, s.group_ids) for s in b]
    for x, y in zip(a, b):
        assert x.metrics == y.metrics
        assert len(x.micro_batches) == len(y.micro_batches)
        for p, q in zip(x.micro_batches, y.micro_batches):
            for f in dataclasses.fields(p):
                u, v = getattr(p, f.name), getattr(q, f.name)
                assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, f.name


def stored_rows(ds: RolloutDataset) -> dict[str, dict]:
    return {r["sample_id"]: r for r in ds.read().to_pylist()}


def rows_of_groups(ds: RolloutDataset) -> dict[str, set[str]]:
    out = collections.defaultdict(set)
    for r in ds.read(columns=["group_id", "sample_id"]).to_pylist():
        out[r["group_id"]].add(r["sample_id"])
    return out


def delivered(steps: list[Step]) -> dict[str, set[str]]:
    """group id -> sample ids, checking that a group shows up in one step only."""
    out: dict[str, set[str]] = {}
    for s in steps:
        for b in s.micro_batches:
            for k, sid in enumerate(b.sample_ids):
                out.setdefault(s.group_ids[int(b.seq_group[k])], set()).add(sid)
        for g in s.group_ids:
            assert sum(g in t.group_ids for t in steps) == 1, f"group {g} in two steps"
    return out


# -- order ---------------------------------------------------------------------------------------


def test_same_seed_same_order_other_seed_or_epoch_other_order(dataset):
    a = run(dataset, cfg(seed=3, num_epochs=2))
    assert_steps_equal(a, run(dataset, cfg(seed=3, num_epochs=2)))
    b = run(dataset, cfg(seed=4, num_epochs=2))
    order = lambda steps, e: [g for s in steps if s.epoch == e for g in s.group_ids]  # noqa: E731
    assert order(a, 0) != order(b, 0)
    assert order(a, 0) != order(a, 1)  # each epoch draws a new order
    assert sorted(order(a, 0)) != order(a, 0)
    assert a[-1].index == len(a) - 1 and [s.epoch for s in a].count(1) == 30  # 60 groups / 2 per step


def test_no_shuffle_reads_the_dataset_in_order(dataset):
    with RolloutLoader(dataset, cfg(shuffle=False)) as loader:
        got = [g for s in loader for g in s.group_ids]
        blocks = loader._stream.blocks
    want = []  # shards by path, their row groups in order, a block's groups by group_id ("ap10" before "ap9")
    for block in blocks:
        ids = pq.ParquetFile(dataset.files[block.shard]).read_row_groups(block.row_groups, columns=["group_id"])
        want += sorted(set(ids.column(0).to_pylist()))
    assert got == want and sorted(got) != got and [b.shard for b in blocks] == sorted(b.shard for b in blocks)


def engine_order(table: pa.Table, seed: int) -> pa.Table:
    """The rows of ``table`` in another order an engine could have finished them in: groups, and each group's
    rows, permuted."""
    rng = np.random.default_rng(seed)
    groups = groups_of(table)
    return pa.concat_tables(groups[i].take(rng.permutation(groups[i].num_rows)) for i in rng.permutation(len(groups)))


ONE_BLOCK = WriterOptions(row_group_bytes=1 << 20, shard_bytes=1 << 22)


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_order_rows_were_finished_in_changes_no_step(tmp_path, shuffle):
    # Two generations of the same rows differ in the order the engine finished them: the loader takes a block's
    # groups in group_id order and their rows in sample_id order, so both give the same steps, bit for bit.
    table = synthetic_table(20, 3, seed=7, uneven_groups=True, **SMALL)
    datasets = [write(tmp_path / str(k), engine_order(table, k), options=ONE_BLOCK) for k in range(3)]
    assert len({tuple(ds.read(columns=["sample_id"]).column(0).to_pylist()) for ds in datasets}) == 3
    config = cfg(shuffle=shuffle, num_epochs=2)
    first = run(datasets[0], config)
    assert len(first) == 20
    for ds in datasets[1:]:
        assert_steps_equal(run(ds, config), first)


def test_a_version_2_state_resumes_in_the_files_order_and_saves_as_version_2(tmp_path):
    # A loader state of version 2 counted its cursor in the file's order: resumed, the loader keeps that order for
    # the run, and the states it saves say version 2, so that a second resume keeps it too.
    ds = write(tmp_path / "ds", engine_order(synthetic_table(20, 3, seed=7, uneven_groups=True, **SMALL), 1),
               options=ONE_BLOCK)
    config = cfg(shuffle=False)
    with RolloutLoader(ds, config) as loader:
        start = {**loader.state_dict(), "version": 2}
    file_order = run(ds, config, state=start)
    in_file = list(dict.fromkeys(ds.read(columns=["group_id"]).column(0).to_pylist()))
    assert [g for s in file_order for g in s.group_ids] == in_file != sorted(in_file)
    with RolloutLoader(ds, config) as loader:
        loader.load_state_dict(start)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["version"] == 2 and state["cursor"]["step"] == 3
    assert_steps_equal(run(ds, config, state=state), file_order[3:])
    assert [g for s in run(ds, config) for g in s.group_ids] == sorted(in_file)  # a new run: version 3's order


def test_a_step_waits_for_the_blocks_of_its_own_groups_not_the_whole_window(tmp_path, monkeypatch):
    # 120 groups in one shuffle window over some 30 blocks: the reader reads the window's blocks in the order its
    # permutation first needs them, so when the first step (2 groups) is out it has read at most the blocks of the
    # steps made so far (the one taken, one ready ahead at prefetch 1, one being made: 6 groups) and its own
    # read-ahead (1 queued, 1 in hand), whatever the timing. Before, the first step waited for the whole window.
    ds = write(tmp_path / "ds", synthetic_table(120, 3, seed=3, uneven_groups=True, **SMALL))
    config = cfg(shuffle_window=128, groups_per_step=2, prefetch=1)
    reads, real = [], stream_mod.read_block
    monkeypatch.setattr(stream_mod, "read_block", lambda *a, **kw: reads.append(a[1]) or real(*a, **kw))
    with RolloutLoader(ds, config) as loader:
        blocks = len(loader._stream.blocks)
        it = iter(loader)
        first = next(it)
        assert len(reads) <= 3 * 2 + 2 < blocks / 2
        steps = [first, *it]
    key = lambda b: (b.shard, b.row_groups)  # noqa: E731
    assert sorted(reads, key=key) == sorted(loader._stream.blocks, key=key)  # each block once
    monkeypatch.undo()
    assert_steps_equal(steps, run(ds, config))


def test_window_permutes_consecutive_stretches_of_the_block_order(dataset):
    with RolloutLoader(dataset, cfg(shuffle_window=5, groups_per_step=1)) as loader:
        stream = loader._stream
        raw = []  # groups in the epoch's block order, each block's groups by group_id
        for b in stream.plan(0).order:
            block = stream.blocks[b]
            ids = pq.ParquetFile(dataset.files[block.shard]).read_row_groups(block.row_groups, columns=["group_id"])
            raw += sorted(set(ids.column(0).to_pylist()))
        got = [g for s in loader for g in s.group_ids]
    assert len(got) == 60 and got != raw
    for k in range(0, 60, 5):  # each window of 5 is a permutation of the next 5 groups of the block order
        assert set(got[k : k + 5]) == set(raw[k : k + 5])
    assert [g[0] for g in raw[:20]] != sorted(g[0] for g in raw[:20])  # blocks of both writers mix


# -- groups whole, content ------------------------------------------------------------------------


def test_steps_hold_whole_groups_and_unpack_to_the_stored_rows(dataset):
    steps = run(dataset, cfg(tail="partial"))
    assert delivered(steps) == rows_of_groups(dataset)
    rows = stored_rows(dataset)
    n = 0
    for s in steps:
        for b in s.micro_batches:
            assert b.num_tokens <= 24 or b.num_sequences == 1
            for u in unpack(b):
                r = rows[u["sample_id"]]
                assert u["prompt_tokens"] == r["prompt_tokens"] and u["response_tokens"] == r["response_tokens"]
                assert u["rollout_logprobs"] == r["rollout_logprobs"] and u["loss_mask"] == r["loss_mask"]
                assert u["temperature"] == r["temperature"] and u["agent"] == r["agent"]
                assert u["reward"] == r["reward"] and u["weight_version"] == r["weight_version"]
                assert s.group_ids[u["group"]] == r["group_id"]
                n += 1
        assert s.metrics["tokens"] == sum(b.num_tokens for b in s.micro_batches)
        assert s.metrics["loss_tokens"] == sum(int(b.loss_mask.sum()) for b in s.micro_batches)
        assert s.metrics["loss_tokens"] == sum(sum(rows[sid]["loss_mask"]) for b in s.micro_batches for sid in b.sample_ids)
        assert s.metrics["packing_efficiency"] == pytest.approx(s.metrics["tokens"] / sum(
            max(24, b.num_tokens) for b in s.micro_batches))
    assert n == dataset.num_rows


# -- data-parallel split --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_split_is_disjoint_and_complete(dataset, world_size):
    all_groups = rows_of_groups(dataset)
    per_rank = [run(dataset, cfg(tail="partial"), r, world_size) for r in range(world_size)]
    assert len({len(steps) for steps in per_rank}) == 1  # every rank takes the same number of steps
    union: dict[str, set[str]] = {}
    for steps in per_rank:
        got = delivered(steps)
        assert not union.keys() & got.keys()
        union.update(got)
    assert set(union) <= set(all_groups) and all(union[g] == all_groups[g] for g in union)
    # full steps hold groups_per_step groups on every rank; only the last may be smaller
    for steps in per_rank:
        assert all(len(s.group_ids) == 2 for s in steps[:-1])

    # default tail policy: drop a rank's incomplete last step, count it and what is left, never duplicate
    per_rank, dropped, left = [], 0, 0
    for r in range(world_size):
        with RolloutLoader(dataset, cfg(), rank=r, world_size=world_size) as loader:
            per_rank.append(list(loader))
            dropped += loader.epoch_stats["tail_dropped_groups"]
            left += loader.epoch_stats["left_groups"]
            assert loader.epoch_stats["groups_examined"] + loader.epoch_stats["left_groups"] == \
                loader._stream.plan(0).shares[r]
    used = sum(len(s.group_ids) for steps in per_rank for s in steps)
    assert all(len(s.group_ids) == 2 for steps in per_rank for s in steps)
    assert used + dropped + left == 60
    assert len({len(steps) for steps in per_rank}) == 1
    if world_size == 1:
        assert (dropped, left) == (0, 0)  # 60 groups, 2 a step


def test_each_rank_takes_its_share_of_the_block_order(dataset):
    # the ranks' pieces are the blocks of the one epoch order, dealt by tokens, in that order
    loaders = [RolloutLoader(dataset, cfg(), rank=r, world_size=3) for r in range(3)]
    plans = [lo._stream.plan(0) for lo in loaders]
    order = plans[0].order.tolist()
    mine = [p.piece_block.tolist() for p in plans]
    # adapted: the remainder's blocks may be sliced between ranks (plan.py), so the pieces, not the blocks, tile
    # the dataset: each block's groups exactly once over the ranks; a sliced block counts whole for each rank
    blocks = loaders[0]._stream.blocks
    covered = collections.defaultdict(list)
    for p in plans:
        for b, start, n in zip(p.piece_block.tolist(), p.piece_start.tolist(), p.piece_groups.tolist()):
            covered[b].append((start, n))
    assert sorted(covered) == sorted(order)  # complete
    for b, parts in covered.items():  # disjoint: the slices of a block tile its groups
        parts.sort()
        assert [s for s, _ in parts] == [0] + list(np.cumsum([n for _, n in parts])[:-1]) and \
            sum(n for _, n in parts) == blocks[b].num_groups
    assert sum(len(parts) > 1 for parts in covered.values()) <= 3  # at most a few sliced (the remainder)
    for m in mine:
        assert m == [b for b in order if b in m]  # in the epoch order
    tokens = [sum(blocks[b].weight for b in m) for m in mine]
    heaviest = max(b.weight for b in blocks)
    assert max(tokens) - min(tokens) <= 2 * heaviest  # balanced to within one block and a sliced one
    for lo in loaders:
        lo.close()


def test_partial_tail_yields_each_ranks_short_last_step(dataset):
    # one rank: 60 = 2 x 25 + 10
    assert [len(s.group_ids) for s in run(dataset, cfg(groups_per_step=25, tail="partial"))] == [25, 25, 10]
    # two ranks of 30 groups each: 4 full steps of 7 and a last one of 2
    shares = RolloutLoader(dataset, cfg(), world_size=2)._stream.plan(0).shares.tolist()
    assert shares == [30, 30]
    for r in range(2):
        assert [len(s.group_ids) for s in run(dataset, cfg(groups_per_step=7, tail="partial"), r, 2)] == [7] * 4 + [2]


# -- resume ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size,rank", [(1, 0), (2, 1), (3, 2)])
def test_resume_is_exact_mid_window_mid_shard_and_across_epochs(dataset, world_size, rank):
    config = cfg(num_epochs=2, tail="partial")
    full = run(dataset, config, rank, world_size)
    assert len(full) > 8
    per_epoch = len(full) // 2
    for k in sorted({1, 2, 3, per_epoch - 1, per_epoch, per_epoch + 1, len(full) - 1, len(full)}):
        with RolloutLoader(dataset, config, rank=rank, world_size=world_size) as loader:
            it = iter(loader)
            for _ in range(k):
                next(it)
            state = json.loads(json.dumps(loader.state_dict()))  # JSON, no pickle
        assert state["cursor"]["step"] == k
        assert_steps_equal(run(dataset, config, rank, world_size, state), full[k:])


def test_each_rank_resumes_from_its_own_state(dataset):
    config = cfg(num_epochs=1)
    loaders = [RolloutLoader(dataset, config, rank=r, world_size=2) for r in range(2)]
    its = [iter(lo) for lo in loaders]
    for _ in range(4):
        for it in its:
            next(it)
    states = [json.loads(json.dumps(lo.state_dict())) for lo in loaders]
    for lo in loaders:
        lo.close()
    assert states[0]["cursor"]["step"] == states[1]["cursor"]["step"] == 4
    assert states[0]["cursor"]["position"] != states[1]["cursor"]["position"] or states[0] != states[1]
    # rank 1 from its own state, or from the list of every rank's (what the trainer keeps)
    assert_steps_equal(run(dataset, config, 1, 2, states[1]), run(dataset, config, 1, 2)[4:])
    assert_steps_equal(run(dataset, config, 1, 2, states), run(dataset, config, 1, 2)[4:])
    with pytest.raises(LoaderStateError, match="rank=0, this loader rank=1: each rank reads its own share"):
        RolloutLoader(dataset, config, rank=1, world_size=2).load_state_dict(states[0])
    with pytest.raises(LoaderStateError, match="holds 2 ranks' states, this loader world_size=4"):
        RolloutLoader(dataset, config, rank=1, world_size=4).load_state_dict(states)


def test_new_iter_continues_from_the_cursor(dataset):
    full = run(dataset, cfg())
    with RolloutLoader(dataset, cfg()) as loader:
        first = [next(iter(loader)) for _ in range(3)]  # each iter() picks up where the last left off
        rest = list(loader)
    assert_steps_equal(first + rest, full)


def test_mismatched_resume_raises(dataset, tmp_path):
    with RolloutLoader(dataset, cfg(), world_size=2) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    with pytest.raises(LoaderStateError, match="world_size=2, this loader world_size=3"):
        RolloutLoader(dataset, cfg(), world_size=3).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="seed=0, this loader seed=1"):
        RolloutLoader(dataset, cfg(seed=1), world_size=2).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="shuffle_window"):
        RolloutLoader(dataset, cfg(shuffle_window=6), world_size=2).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="not a rollshard loader state"):
        RolloutLoader(dataset, cfg(), world_size=2).load_state_dict({"epoch": 0})
    # the dataset changed: another writer committed a shard
    table = dataset.read()
    write(tmp_path, table, "w0", WriterOptions())
    before = RolloutDataset.open(tmp_path)
    with RolloutLoader(before, cfg(), world_size=2) as loader:
        next(iter(loader))
        state = loader.state_dict()
    write(tmp_path, synthetic_table(2, 2, seed=9, prefix="c", **SMALL), "w1")
    with pytest.raises(LoaderStateError, match="dataset=.*shards were added, removed or rewritten"):
        RolloutLoader(tmp_path, cfg(), world_size=2).load_state_dict(state)
    # settings that do not move the cursor may change: the budget only changes the packing
    RolloutLoader(before, cfg(micro_batch_tokens=64), world_size=2, rank=0).load_state_dict(state)


# -- filters --------------------------------------------------------------------------------------


def with_columns(table: pa.Table, **cols) -> pa.Table:
    for name, values in cols.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(name), pa.array(values, table.schema.field(name).type))
    return table


def totals(steps: list[Step], epoch_stats: dict) -> dict:
    """Per-step filter counts summed, checked against the epoch totals."""
    out = collections.Counter()
    for s in steps:
        out.update({k: v for k, v in s.metrics.items() if k.startswith("filtered") or k.endswith("examined")})
    for k, v in out.items():
        assert epoch_stats[k] == v, k
    return dict(out)


def test_status_and_agent_filters_with_counts(tmp_path):
    t = synthetic_table(30, 3, seed=5, uneven_groups=True, agents=("solver", "rewriter", "selector"), **SMALL)
    rng = np.random.default_rng(0)
    status = rng.choice(["completed", "truncated", "aborted", "failed"], t.num_rows, p=[0.5, 0.2, 0.2, 0.1]).tolist()
    reward = [None if s == "failed" else r for s, r in zip(status, t.column("reward").to_pylist())]
    t = with_columns(t, status=status, reward=reward)
    ds = write(tmp_path, t)
    config = cfg(agents=("solver", "selector"), tail="partial")
    with RolloutLoader(ds, config) as loader:
        steps = list(loader)
        stats = loader.epoch_stats
    rows = t.to_pylist()
    status_ok = [r["status"] in ("completed", "truncated") for r in rows]
    agent_ok = [r["agent"] in ("solver", "selector") for r in rows]
    keep = collections.defaultdict(set)
    for r, s, a in zip(rows, status_ok, agent_ok):
        keep[r["group_id"]]  # every group, even when all its rows go
        if s and a:
            keep[r["group_id"]].add(r["sample_id"])
    expected = {
        "groups_examined": 30,
        "rows_examined": t.num_rows,
        "filtered_rows/status": status_ok.count(False),
        "filtered_rows/agent": sum(s and not a for s, a in zip(status_ok, agent_ok)),
        "filtered_groups/empty": sum(not v for v in keep.values()),
    }
    got = totals(steps, stats)
    assert {k: got[k] for k in expected} == expected
    assert expected["filtered_rows/status"] > 5 and expected["filtered_rows/agent"] > 5
    assert expected["filtered_groups/empty"] > 5
    assert delivered(steps) == {g: v for g, v in keep.items() if v}
    assert {a for s in steps for b in s.micro_batches for a in b.agents} == {"solver", "selector"}


def test_staleness_filter_with_counts_and_unknown_versions(tmp_path):
    t = synthetic_table(40, 3, seed=6, uneven_groups=True, weight_versions=("0", "1", "2", "3"), **SMALL)
    versions = t.column("weight_version").to_pylist()
    versions[::7] = [None] * len(versions[::7])
    t = with_columns(t, weight_version=versions)
    ds = write(tmp_path, t)
    config = cfg(max_staleness=1, current_version="3", tail="partial")
    with RolloutLoader(ds, config) as loader:
        steps = list(loader)
        stats = loader.epoch_stats
    # staleness = 3 - version; keep staleness <= 1, i.e. versions 2 and 3; null versions are skipped apart
    got = totals(steps, stats)
    assert got["filtered_rows/no_version"] == versions.count(None)
    assert got["filtered_rows/stale"] == sum(v in ("0", "1") for v in versions)
    assert got["filtered_rows/stale"] > 10
    assert {v for s in steps for b in s.micro_batches for v in b.weight_versions} == {"2", "3"}
    kept = sum(v in ("2", "3") for v in versions)
    assert sum(s.num_sequences for s in steps) == kept

    with pytest.raises(ValueError, match="max_staleness needs the policy version"):
        iter(RolloutLoader(ds, cfg(max_staleness=1)))
    with pytest.raises(ValueError, match="current_version 'default' is not an integer"):
        RolloutLoader(ds, cfg(max_staleness=1, current_version="default"))


def test_version_change_during_iteration_replans_prefetched_steps(tmp_path):
    t = synthetic_table(60, 2, seed=7, weight_versions=("0", "1", "2", "3", "4"), **SMALL)
    ds = write(tmp_path, t)
    config = cfg(max_staleness=1, current_version="2", prefetch=4)
    with RolloutLoader(ds, config) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        state = loader.state_dict()
        loader.set_current_version("4")  # prefetched steps planned with version 2 no longer hold
        tail = list(it)
    assert {v for s in head for b in s.micro_batches for v in b.weight_versions} <= {"1", "2", "3", "4"}
    assert {v for s in tail for b in s.micro_batches for v in b.weight_versions} == {"3", "4"}
    # the same as a loader resumed at that step with the new version
    state["current_version"] = "4"
    assert_steps_equal(tail, run(ds, config, state=state))
    # a change that no decision depends on keeps the prefetched steps (and the same steps come out)
    with RolloutLoader(ds, cfg(max_staleness=10, current_version="4")) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(2)]
        loader.set_current_version("5")
        rest = list(it)
    assert_steps_equal(head + rest, run(ds, cfg(max_staleness=10, current_version="4")))


def test_zero_variance_groups_counted_and_optionally_dropped(tmp_path):
    t = synthetic_table(30, 3, seed=8, uneven_groups=True, **SMALL)
    groups = t.column("group_id").to_pylist()
    rewards = collections.defaultdict(list)
    for g, r in zip(groups, t.column("reward").to_pylist()):
        rewards[g].append(r)
    # All equal with two rows or more (store.groups): a one-row group is trained (its advantage is its reward).
    flat = {g: len(r) >= 2 and len(set(r)) == 1 for g, r in rewards.items()}
    assert 3 < sum(flat.values()) < 25 and any(len(r) == 1 for r in rewards.values())
    ds = write(tmp_path, t)
    with RolloutLoader(ds, cfg(tail="partial")) as loader:
        steps = list(loader)
    assert sum(s.metrics["zero_variance_groups"] for s in steps) == sum(flat.values())
    with RolloutLoader(ds, cfg(tail="partial", drop_zero_variance=True)) as loader:
        steps = list(loader)
        got = totals(steps, loader.epoch_stats)
    assert got["filtered_groups/zero_variance"] == sum(flat.values())
    assert got["filtered_rows/zero_variance"] == sum(len(rewards[g]) for g, f in flat.items() if f)
    assert set(delivered(steps)) == {g for g, f in flat.items() if not f}
    assert all(s.metrics["zero_variance_groups"] == 0 for s in steps)


def test_an_epoch_without_a_step_raises_when_looping_forever(dataset):
    from rollshard.store.loader import NoStepError, NoStepWarning

    config = cfg(agents=("nobody",), num_epochs=None)
    with pytest.raises(NoStepError, match="epoch 0 yields no step: 0 of 60 groups pass the filters"):
        next(iter(RolloutLoader(dataset, config)))
    # Bounded epochs: the run ends without a step, said by a warning of its own type (never matched by text).
    with pytest.warns(NoStepWarning, match="epoch 0 yields no step"), RolloutLoader(dataset, cfg(agents=("nobody",))) as it:
        assert list(it) == []


def test_every_loader_is_a_step_loader_and_names_its_datasets(dataset, tmp_path):
    from rollshard.store.loader import StepLoader
    from rollshard.store.loader.follow import FollowLoader
    from rollshard.store.loader.mixture import open_loader

    import shutil

    copy = shutil.copytree(dataset.storage.root, tmp_path / "copy")
    one = RolloutLoader(dataset, cfg())
    mixed = open_loader(f"a={dataset.storage.root}:0.5,b={copy}:0.5", cfg())
    follow = FollowLoader(dataset.storage.root, cfg())
    for loader in (one, mixed, follow):
        assert isinstance(loader, StepLoader)
        assert [d.fingerprint for d in loader.datasets] in ([dataset.fingerprint], [dataset.fingerprint] * 2)
        loader.close()
    assert one.num_groups == 60 and mixed.num_groups == 120 and follow.num_groups is None
    assert one.groups_before_end is None and mixed.groups_before_end is not None


def test_the_trainer_takes_a_step_loader_only(tiny_gpt2, tmp_path):
    from rollshard.train.config import TrainConfig
    from rollshard.train.trainer import Trainer

    config = TrainConfig.from_dict({"data": {"path": str(tmp_path / "data")}, "model": {"path": str(tiny_gpt2)},
                                    "trainer": {"out": str(tmp_path / "out")}})
    with pytest.raises(TypeError, match="loader is a list; the trainer takes a rollshard.store.loader.StepLoader"):
        Trainer(config, loader=[])


def test_bad_config_raises():
    with pytest.raises(ValueError, match="statuses .*choose one or more of completed"):
        LoaderConfig(statuses=("done",)).check()
    with pytest.raises(ValueError, match="groups_per_step must be at least 1"):
        LoaderConfig(groups_per_step=0).check()
    with pytest.raises(ValueError, match="micro_batch_support must be at least 1 or None"):
        LoaderConfig(micro_batch_support=0).check()


def test_steps_with_supports_respect_the_support_budget(tmp_path):
    # top-k 20 on every token: a response of 1-11 tokens carries 20-220 ids; a budget of 100 binds.
    ds = write(tmp_path, synthetic_table(12, 3, seed=6, top_k=20, **SMALL))
    free = run(ds, cfg(shuffle=False))  # default budget 64 x 24 ids: never binds at top-k 20
    bound = run(ds, cfg(shuffle=False, micro_batch_support=100))
    alone = 0
    for f, b in zip(free, bound, strict=True):
        assert f.group_ids == b.group_ids  # the same groups and sequences, only cut differently
        assert sorted(i for m in f.micro_batches for i in m.sample_ids) == sorted(
            i for m in b.micro_batches for i in m.sample_ids)
        assert b.metrics["micro_batches"] == len(b.micro_batches) >= len(f.micro_batches)
        assert max(len(m.support_ids) for m in f.micro_batches) > 100  # the token budget alone lets it pass
        for m in b.micro_batches:
            assert m.num_tokens <= 24 or m.num_sequences == 1
            assert len(m.support_ids) <= 100 or m.num_sequences == 1
            alone += len(m.support_ids) > 100
    assert alone > 0 and sum(len(s.micro_batches) for s in bound) > sum(len(s.micro_batches) for s in free)
    assert_steps_equal(free, run(ds, cfg(shuffle=False, micro_batch_support=64 * 24)))  # None means 64 x tokens


# -- groups and files -----------------------------------------------------------------------------


def test_a_group_spanning_two_shards_raises(tmp_path):
    t = synthetic_table(4, 3, seed=1, **SMALL)
    write(tmp_path, t.slice(0, 5), "w0")  # group p1 split: 2 rows here ...
    with ShardWriter(tmp_path, writer_id="w1", options=WriterOptions(validate=True)) as w:
        w.write_groups(t.slice(5))  # ... 1 row here
    with pytest.raises(ValueError, match="group 'p1/policy/0' has rows in shards shards/w0-00000.parquet, shards/w1"):
        RolloutLoader(tmp_path, cfg())


def recommit(root, rel: str) -> None:
    """Record a rewritten shard's new size and checksum in its manifest entry (the loader checks both)."""
    storage = Storage(root)
    for path in (root / "_manifests").glob("*.json"):
        doc = json.loads(path.read_text())
        for entry in doc["shards"]:
            if entry["path"] == rel:  # its row groups are no longer the writer's: the loader scans them
                entry.update(bytes=storage.size(rel), sha256=storage.sha256(rel), row_groups=None)
        path.write_text(json.dumps(doc))


def test_a_group_spanning_row_groups_is_read_whole(tmp_path):
    t = synthetic_table(12, 4, seed=3, uneven_groups=True, **SMALL)
    ds = write(tmp_path, t, options=WriterOptions())
    path = ds.files[0]
    meta = pq.read_schema(path).metadata
    pq.write_table(pq.read_table(path).replace_schema_metadata(meta), path, row_group_size=3)  # splits groups
    recommit(tmp_path, ds.shards[0].path)
    assert pq.ParquetFile(path).metadata.num_row_groups > 10
    steps = run(RolloutDataset.open(tmp_path), cfg(tail="partial", shuffle_window=3))
    assert delivered(steps) == rows_of_groups(ds)


# -- threads --------------------------------------------------------------------------------------


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rollshard-loader")]


def test_close_and_abandoned_iterators_stop_the_threads(dataset):
    loader = RolloutLoader(dataset, cfg(num_epochs=None))
    it = iter(loader)
    next(it)
    assert len(loader_threads()) == 2  # reader and packer (and, while shards are being hashed, a checksum thread)
    loader.close()
    assert loader_threads() == []
    assert not [t for t in threading.enumerate() if t.name.startswith("rollshard-checksum")]
    it = iter(loader)
    next(it)
    del it  # an abandoned iterator stops its threads
    assert loader_threads() == []


def test_interpreter_exits_with_an_unfinished_loader(dataset):
    script = textwrap.dedent(
        f"""
        from rollshard.store.loader import LoaderConfig, RolloutLoader
        it = iter(RolloutLoader({dataset.storage.root!r}, LoaderConfig(groups_per_step=2, num_epochs=None, prefetch=1)))
        next(it)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- HF datasets ----------------------------------------------------------------------------------


def test_hf_groups_agree_with_the_loader(dataset):
    from datasets.distributed import split_dataset_by_node

    config = cfg(tail="partial", agents=("policy",), drop_zero_variance=True)
    loader_rows = {}
    for steps in (run(dataset, config, r, 2) for r in range(2)):
        for s in steps:
            for b in s.micro_batches:
                for u in unpack(b):
                    loader_rows[u["sample_id"]] = (s.group_ids[u["group"]], u)
    hf = hf_groups(dataset, config)
    seen: dict[str, str] = {}
    for world_size in (2, 3):
        seen = {}
        for rank in range(world_size):
            for ex in split_dataset_by_node(hf, rank=rank, world_size=world_size):
                for i, sid in enumerate(ex["sample_id"]):
                    assert sid not in seen
                    seen[sid] = ex["group_id"]
                    group, u = loader_rows[sid]
                    assert group == ex["group_id"]
                    assert ex["prompt_tokens"][i] == u["prompt_tokens"]
                    assert ex["response_tokens"][i] == u["response_tokens"]
                    assert ex["rollout_logprobs"][i] == u["rollout_logprobs"]
                    assert ex["loss_mask"][i] == u["loss_mask"]
                    assert ex["reward"][i] == u["reward"]
        assert seen.keys() == loader_rows.keys()


def test_failed_rows_without_reward_are_dropped_and_counted(tmp_path):
    # Training on "failed" is allowed, but a null reward would make its group's advantages NaN.
    t = synthetic_table(4, 3, seed=6, **SMALL)
    status = ["completed", "failed", "failed"] + ["completed"] * 9
    reward = [1.0, None, 0.0] + [0.5] * 9  # one failed row has no reward, the other has one
    t = with_columns(t, status=status, reward=reward)
    ds = write(tmp_path, t)
    with RolloutLoader(ds, cfg(statuses=("completed", "failed"), tail="partial")) as loader:
        steps = list(loader)
        stats = loader.epoch_stats
    got = totals(steps, stats)
    assert got["filtered_rows/no_reward"] == 1
    assert got["filtered_rows/status"] == 0
    rewards = [r for s in steps for b in s.micro_batches for r in b.rewards.tolist()]
    assert len(rewards) == 11 and all(np.isfinite(rewards))


def test_a_block_decodes_the_same_from_the_pooled_buffer_and_from_the_mapping(tmp_path):
    """block_reader: the pooled buffer (the footer puts the block's column chunks inside its bytes) and the fallback
    mapping (any other layout) hand Parquet the same block."""
    import pyarrow.parquet as pq

    from rollshard.store.loader.stream import block_reader, chunks_within

    table = synthetic_table(12, 3, seed=4, **SMALL)
    with ShardWriter(tmp_path, writer_id="w0", options=WriterOptions(row_group_bytes=1, shard_bytes=1 << 40)) as w:
        for i in range(0, table.num_rows, 9):
            w.write_groups(table.slice(i, 9))  # a row group per call
    ds = RolloutDataset.open(tmp_path)
    info = ds.shards[0]
    assert len(info.row_groups) > 2
    path = tmp_path / info.path
    footer = pq.ParquetFile(path).metadata
    rgs = (1, 2)
    offset, end = info.row_groups[1].offset, info.row_groups[2].offset + info.row_groups[2].length
    expect = pq.ParquetFile(path).read_row_groups(list(rgs))
    with open(path, "rb") as f:
        pooled, raw = block_reader(f, info.bytes, offset, end, footer, rgs)
        mapped, raw_m = block_reader(f, info.bytes, offset, end)  # no footer: the mapping
    assert bytes(raw) == bytes(raw_m) == path.read_bytes()[offset:end]
    for held in (pooled, mapped):
        assert pq.ParquetFile(held, metadata=footer).read_row_groups(list(rgs)).equals(expect)
    assert pooled.size() == mapped.size() == info.bytes
    # one byte short of the block's last chunk, or a row group from outside it: the mapping (reads elsewhere see 0)
    assert chunks_within(footer, rgs, offset, end)
    assert not chunks_within(footer, rgs, offset, end - 1) and not chunks_within(footer, (0, 1), offset, end)

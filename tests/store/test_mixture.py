"""The weighted mixture of datasets (store/loader/mixture.py): parsing, the allocation rule, ranks, end of data, resume."""

import collections
import json
import re
import threading
from fractions import Fraction

import pytest

from rollshard.store.loader import LoaderConfig, LoaderStateError, RolloutLoader, Step
from rollshard.store.loader.mixture import MixtureLoader, Source, allocate, open_loader, parse_sources, sources_text
from rollshard.store.loader.plan import Cursor, EpochEnd
from rollshard.store.synthetic import synthetic_table
from tests.store.test_loader import (
    ONE_BLOCK, SMALL, assert_steps_equal, delivered, engine_order, rows_of_groups, with_columns, write,
)

A_GROUPS, B_GROUPS = 60, 40


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[str, str]:
    """Dataset ``a``: 60 groups over several shards; ``b``: 40 groups. Group ids of the two overlap (p0/...)."""
    root = tmp_path_factory.mktemp("mix")
    write(root / "a", synthetic_table(A_GROUPS, 3, seed=11, uneven_groups=True, **SMALL))
    write(root / "b", synthetic_table(B_GROUPS, 3, seed=12, uneven_groups=True, **SMALL))
    return str(root / "a"), str(root / "b")


def cfg(**kw) -> LoaderConfig:
    base = dict(groups_per_step=10, micro_batch_tokens=48, shuffle_window=7, prefetch=2)
    return LoaderConfig(**{**base, **kw})


def mix(two, weights=("0.7", "0.3")) -> str:
    return ",".join(f"{p}:{w}" for p, w in zip(two, weights))


def run(data: str, config: LoaderConfig, rank: int = 0, world_size: int = 1, state: dict | None = None) -> list[Step]:
    with MixtureLoader(data, config, rank=rank, world_size=world_size) as loader:
        if state is not None:
            loader.load_state_dict(state)
        return list(loader)


def origins(steps: list[Step]) -> list[list[tuple[str, str]]]:
    return [list(zip(s.group_sources, s.group_ids)) for s in steps]


# -- parsing -------------------------------------------------------------------------------------


def test_parse_sources_weights_names_and_uris(tmp_path):
    a, b = parse_sources("a:0.7,b:0.3")
    assert (a.name, a.path, a.weight) == ("a", "a", Fraction(7, 10)) and (b.path, b.weight) == ("b", Fraction(3, 10))
    # the weight is the text after the last ':' only when it is a number: a URI's own ':' is part of the path
    x, y = parse_sources("s3://bucket/x:0.3, s3://bucket/y:2")
    assert (x.name, x.path, x.weight) == ("x", "s3://bucket/x", Fraction(3, 10))
    assert (y.path, y.weight) == ("s3://bucket/y", 2)
    assert parse_sources("s3://bucket/x") == [Source(name="x", path="s3://bucket/x", weight=None)]
    assert parse_sources("run:2:1")[0].path == "run:2"
    # names: explicit, else the folder's name, de-duplicated in order
    m, n = parse_sources(f"math=s3://b/data:1,{tmp_path}/code/data:3")
    assert (m.name, m.path, n.name) == ("math", "s3://b/data", "data")
    assert [s.name for s in parse_sources(f"{tmp_path}/1/data,{tmp_path}/2/data,{tmp_path}/_x")] == [
        "data", "data-2", "x"]
    assert [s.weight for s in parse_sources("a,b")] == [None, None]  # equal weights


@pytest.mark.parametrize(
    "spec,message",
    [
        ("a:0,b:1", "weight 0 must be a positive finite number"),
        ("a:-0.5,b:1", "weight -0.5 must be a positive"),
        ("a:nan,b:1", "weight nan must be"),
        ("a:inf,b:1", "weight inf must be"),
        ("a:,b:1", "ends in ':' without a weight"),
        ("a:0.7,b", "b has no weight"),
        ("a:0.7,,b:0.3", "empty entry"),
        ("a:1,./a:2", "listed twice"),
    ],
)
def test_bad_data_specs_are_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_sources(spec)
    assert "\n" not in str(e.value)


def test_yaml_list_form():
    assert sources_text([{"path": "s3://b/x", "weight": 0.7}, {"path": "y", "weight": 0.3, "name": "code"}]) == (
        "s3://b/x:0.7,code=y:0.3")
    with pytest.raises(ValueError, match="comma"):
        sources_text([{"path": "a,b", "weight": 1}])


# -- allocation ----------------------------------------------------------------------------------


def test_allocation_worked_example():
    # W = (7, 3), T = 10; slot s goes to argmax_i W_i (s+1) - 10 taken_i:
    # s=0: 7 vs 3 -> a; s=1: 14-10=4 vs 6 -> b; s=2: 11 vs -1 -> a; s=3: 8 vs 2 -> a; s=4: 5 vs 5 (tie) -> a;
    # s=5: 2 vs 8 -> b; s=6: 9 vs 1 -> a; s=7: 6 vs 4 -> a; s=8: 3 vs 7 -> b; s=9: 10 vs 0 -> a; then it repeats.
    assert allocate([0.7, 0.3], 10) == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    assert allocate([7, 3], 30) == allocate([0.7, 0.3], 10) * 3  # weights are normalized
    assert allocate([0.7, 0.3], 10, start=[7, 3]) == allocate([0.7, 0.3], 10)  # only the counters matter
    # three sources: after every prefix, each count is within 1 of its share
    w = [Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)]
    taken = [0, 0, 0]
    for s, i in enumerate(allocate(w, 200), start=1):
        taken[i] += 1
        assert all(abs(t - s * float(x)) < 1 for t, x in zip(taken, w))
    assert taken == [100, 60, 40]


def test_steps_hold_the_allocation_and_each_source_its_own_stream(two):
    with MixtureLoader(mix(two), cfg()) as loader:
        steps = list(loader)
        stats = loader.epoch_stats
    # a gives 7 groups a step: 60 = 8 x 7 + 4, so in step 9 a has 4 left (slots 0, 2, 3, 4) and runs out at slot 6;
    # the 6 groups of that step (4 of a, 2 of b) are dropped. b gave 8 x 3 + 2 of its 40.
    assert len(steps) == 8
    for s in steps:
        assert s.group_sources == ["a", "b", "a", "a", "a", "b", "a", "a", "b", "a"]
        assert (s.metrics["source/a/groups"], s.metrics["source/b/groups"]) == (7, 3)
        assert s.metrics["groups"] == 10 and s.metrics["groups_examined"] == 10
    assert stats["tail_dropped_groups"] == 6
    assert (stats["source/a/tail_dropped_groups"], stats["source/b/tail_dropped_groups"]) == (4, 2)
    assert (stats["source/a/exhausted"], stats.get("source/b/exhausted", 0)) == (1, 0)
    assert (stats["source/a/groups"], stats["source/b/groups"], stats["steps"]) == (56, 24, 8)
    # each source's groups come in the order of that dataset's own loader (the mixture never reorders a stream)
    for name, path in zip("ab", two):
        with RolloutLoader(path, cfg(groups_per_step=1)) as single:
            alone = [g for s in single for g in s.group_ids]
        got = [g for s in steps for src, g in zip(s.group_sources, s.group_ids) if src == name]
        assert got == alone[: len(got)]
    # per-source sizes are those of the rows delivered
    rows = {src: rows_of_groups(open_loader(p).dataset) for src, p in zip("ab", two)}
    for s in steps:
        seqs = collections.Counter()
        for b in s.micro_batches:
            for g in b.seq_group.tolist():
                seqs[s.group_sources[g]] += 1
        for src in "ab":
            assert s.metrics[f"source/{src}/sequences"] == seqs[src] == sum(
                len(rows[src][g]) for o, g in zip(s.group_sources, s.group_ids) if o == src)
        assert sum(s.metrics[f"source/{x}/loss_tokens"] for x in "ab") == s.metrics["loss_tokens"]
        assert sum(s.metrics[f"source/{x}/tokens"] for x in "ab") == s.metrics["tokens"]

    partial = run(mix(two), cfg(tail="partial"))
    assert_steps_equal(partial[:8], steps)
    assert partial[8].group_sources == ["a", "b", "a", "a", "a", "b"]


def test_two_loaders_give_the_same_steps_and_another_seed_others(two):
    a = run(mix(two), cfg(num_epochs=2))
    assert_steps_equal(a, run(mix(two), cfg(num_epochs=2)))
    assert [s.group_sources for s in a] == [s.group_sources for s in run(mix(two), cfg(num_epochs=2))]
    assert origins(a) != origins(run(mix(two), cfg(num_epochs=2, seed=5)))


def rank_stream(path: str, config: LoaderConfig, rank: int, world_size: int, n: int) -> list[str]:
    """The first ``n`` group ids of one dataset's raw stream on ``rank`` (what a mixture draws that source from)."""
    with RolloutLoader(path, config, rank=rank, world_size=world_size) as lo:
        st, out = lo._stream, []
        reader = st.reader(Cursor(), {})
        try:
            for g in st.groups(Cursor(), reader, {}, threading.Event()):
                if not isinstance(g, EpochEnd):
                    out.append(g[2].group_ids[g[3]])
                if len(out) == n:
                    break
        finally:
            reader.close()
    return out


@pytest.mark.parametrize("world_size,groups_per_step", [(2, 5), (3, 4)])
def test_ranks_draw_each_source_from_their_own_share(two, world_size, groups_per_step):
    per_rank = cfg(groups_per_step=groups_per_step, tail="partial")
    ranks = [run(mix(two), per_rank, r, world_size) for r in range(world_size)]
    seen: set[tuple[str, str]] = set()
    for r, steps in enumerate(ranks):
        slots = [src for s in steps for src in s.group_sources]
        assert slots == [("a", "b")[i] for i in allocate([0.7, 0.3], len(slots))]  # the schedule on its own slots
        for src, path in zip("ab", two):
            got = [gid for s in steps for o, gid in zip(s.group_sources, s.group_ids) if o == src]
            assert got == rank_stream(path, per_rank, r, world_size, len(got))  # this rank's share, in its order
        mine = {(o, gid) for s in steps for o, gid in zip(s.group_sources, s.group_ids)}
        assert not mine & seen  # shares are disjoint (one epoch of each source)
        seen |= mine
    # every group a rank trains on is whole (all its rows of its own source)
    rows = {src: rows_of_groups(open_loader(p).dataset) for src, p in zip("ab", two)}
    for steps in ranks:
        for s in steps:
            got = collections.defaultdict(set)
            for b in s.micro_batches:
                for k, sid in enumerate(b.sample_ids):
                    got[int(b.seq_group[k])].add(sid)
            for g, (src, gid) in enumerate(zip(s.group_sources, s.group_ids)):
                assert got[g] == rows[src][gid]


@pytest.mark.parametrize("world_size,rank,groups_per_step", [(1, 0, 10), (2, 1, 3)])
def test_resume_mid_run_equals_the_uninterrupted_run(two, world_size, rank, groups_per_step):
    # 10 slots a step are the schedule's period (7 + 3); 6 a step (2 x 3) stop it mid-period
    config = cfg(groups_per_step=groups_per_step, num_epochs=2, tail="partial")
    full = run(mix(two), config, rank, world_size)
    # rank 1 of 2 draws from its own shares: a's 30 + 30 groups of the two epochs (the remainder's blocks level the
    # shares; whole blocks alone gave 29 + 30) are used up in 29 steps
    assert len(full) == (18 if groups_per_step == 10 else 29)
    # with 10 a step, b (40 groups, 3 a step) crosses its first epoch end in step 14 (index 13): both sides of it
    for k in sorted({1, 5, 13, 14, 20, len(full) - 1, len(full)} & set(range(len(full) + 1))):
        with MixtureLoader(mix(two), config, rank=rank, world_size=world_size) as loader:
            it = iter(loader)
            for _ in range(k):
                next(it)
            state = json.loads(json.dumps(loader.state_dict()))  # JSON, no pickle
        assert state["step"] == k
        rest = run(mix(two), config, rank, world_size, state)
        assert_steps_equal(rest, full[k:])
        assert origins(rest) == origins(full[k:])
    with MixtureLoader(mix(two), config, rank=rank, world_size=world_size) as loader:
        list(loader)
        state = loader.state_dict()
    assert state["ended"] and [s["epoch"] for s in state["sources"]] == [2, 1]


def test_a_version_2_state_resumes_each_source_in_its_files_order(tmp_path):
    # As for one dataset (test_loader.py): a version-2 state's cursors count groups in the files' order, kept for the
    # run and saved as version 2; a new run takes each block's groups by group_id.
    stored = {}  # source -> its group ids in the file's order
    for k, (n, src) in enumerate([(12, "a"), (8, "b")]):
        table = engine_order(synthetic_table(n, 3, seed=k, uneven_groups=True, prefix=src, **SMALL), k)
        ds = write(tmp_path / src, table, options=ONE_BLOCK)
        stored[src] = list(dict.fromkeys(ds.read(columns=["group_id"]).column(0).to_pylist()))
    data, config = f"{tmp_path / 'a'}:0.5,{tmp_path / 'b'}:0.5", cfg(groups_per_step=4, shuffle=False)
    with MixtureLoader(data, config) as loader:
        start = {**loader.state_dict(), "version": 2}
    file_order, new = run(data, config, state=start), run(data, config)
    assert len(file_order) == len(new) == 4
    for src, ids in stored.items():
        took = lambda steps: [g for s in steps for o, g in zip(s.group_sources, s.group_ids) if o == src]  # noqa: E731
        assert took(file_order) == ids[: len(took(file_order))] and took(new) == sorted(ids)[: len(took(new))]
    with MixtureLoader(data, config) as loader:
        loader.load_state_dict(start)
        it = iter(loader)
        next(it)
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["version"] == 2
    assert_steps_equal(run(data, config, state=state), file_order[1:])


def test_epoch_stats_follow_the_sources_epochs(two):
    with MixtureLoader(mix(two), cfg(num_epochs=2)) as loader:
        seen = []
        for _ in loader:
            seen.append((loader.epoch_stats.get("source/a/epochs", 0), loader.epoch_stats.get("source/b/epochs", 0)))
        stats = loader.epoch_stats
    # a (7 a step) needs its 61st group in step 9, b (3 a step) its 41st in step 14; as for one dataset, epoch_stats
    # takes an epoch's end when the step after the one that crossed it is asked for
    assert seen == [(0, 0)] * 9 + [(1, 0)] * 5 + [(1, 1)] * 3
    assert (stats["source/a/epochs"], stats["source/b/epochs"], stats["source/a/exhausted"]) == (2, 1, 1)
    assert stats["groups_examined"] == stats["source/a/groups_examined"] + stats["source/b/groups_examined"]
    # a's 120 groups fill 17 steps (119) and slot 0 of the 18th; its slot 2 finds none: that tail of 2 is dropped
    assert (stats["steps"], stats["tail_dropped_groups"], stats["source/b/groups"]) == (17, 2, 51)


def test_changed_weights_sources_or_data_refuse_to_resume(two, tmp_path):
    with MixtureLoader(mix(two), cfg()) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with pytest.raises(LoaderStateError, match=r"weights a:0.7, b:0.3, this loader a:0.6, b:0.4: the weights changed"):
        MixtureLoader(mix(two, ("0.6", "0.4")), cfg()).load_state_dict(state)
    MixtureLoader(mix(two, ("7", "3")), cfg()).load_state_dict(state)  # the same weights, written otherwise
    with pytest.raises(LoaderStateError, match="mixes sources a, b, this loader b, a: the source list changed"):
        MixtureLoader(f"{two[1]}:0.3,{two[0]}:0.7", cfg()).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="loader state is of a mixture of sources a, b, this loader reads one"):
        RolloutLoader(two[0], cfg()).load_state_dict(state)
    with RolloutLoader(two[0], cfg()) as single:
        next(iter(single))
        with pytest.raises(LoaderStateError, match="loader state is of one dataset .*this loader mixes several"):
            MixtureLoader(mix(two), cfg()).load_state_dict(single.state_dict())
    with pytest.raises(LoaderStateError, match="world_size=1, this loader world_size=2"):
        MixtureLoader(mix(two), cfg(groups_per_step=5), world_size=2).load_state_dict(state)
    # source b changed: another writer committed a shard
    b = tmp_path / "b"
    write(b, synthetic_table(20, 2, seed=3, **SMALL))
    data = f"{two[0]}:0.7,{b}:0.3"
    with MixtureLoader(data, cfg()) as loader:
        next(iter(loader))
        state = loader.state_dict()
    write(b, synthetic_table(2, 2, seed=4, prefix="c", **SMALL), "w1")
    with pytest.raises(LoaderStateError, match=r"source b \(.*\): loader state has dataset=.*shards were added"):
        MixtureLoader(data, cfg()).load_state_dict(state)


def test_version_change_replans_every_source(tmp_path):
    t = lambda seed: synthetic_table(30, 2, seed=seed, weight_versions=("0", "1", "2", "3", "4"), **SMALL)  # noqa: E731
    write(tmp_path / "a", t(1))
    write(tmp_path / "b", t(2))
    data = f"{tmp_path / 'a'}:0.5,{tmp_path / 'b'}:0.5"
    config = cfg(groups_per_step=2, max_staleness=1, current_version="2", prefetch=4)
    with MixtureLoader(data, config) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        state = loader.state_dict()
        loader.set_current_version("4")
        tail = list(it)
    assert {v for s in tail for b in s.micro_batches for v in b.weight_versions} == {"3", "4"}
    assert {v for s in head for b in s.micro_batches for v in b.weight_versions} >= {"1", "2"}
    state["current_version"] = "4"
    assert_steps_equal(tail, run(data, config, state=state))


def test_a_source_without_a_passing_group_ends_or_raises(two, tmp_path):
    t = synthetic_table(10, 2, seed=5, **SMALL)
    write(tmp_path / "aborted", with_columns(t, status=["aborted"] * t.num_rows))
    data = f"{two[0]}:0.5,{tmp_path / 'aborted'}:0.5"
    with pytest.warns(UserWarning, match="the mixture yields no step: source aborted ran out after 0 groups"):
        assert run(data, cfg()) == []
    with pytest.raises(ValueError, match="source aborted: epoch 0 yields no group"):
        run(data, cfg(num_epochs=None))


def test_one_source_is_the_single_dataset_loader(two):
    loader = open_loader(f"{two[0]}:0.7", cfg())
    assert type(loader) is RolloutLoader
    with loader:
        got = list(loader)
    with RolloutLoader(two[0], cfg()) as single:
        assert_steps_equal(got, list(single))
    assert delivered(got)


def test_source_figures_of_a_step_worked_example():
    import numpy as np

    from rollshard.store.loader.assemble import source_metrics
    from rollshard.store.loader.packing import Sequences, pack_step

    # Four sequences of 3, 0 (empty), 4 and 2 tokens, of groups 0, 1, 1, 0 (sources x, y); prompts of 1, 0, 2, 1
    # tokens, response masks [1 1], [], [0 1], [0]: x has 2 sequences, 3 + 2 = 5 tokens, 2 + 0 = 2 loss tokens;
    # y 2, 0 + 4, 0 + 1.
    prompts, masks = [[5], [], [5, 6], [7]], [[1, 1], [], [0, 1], [0]]
    seqs = Sequences(
        prompt=[np.array(p, np.int32) for p in prompts], response=[np.ones(len(m), np.int32) for m in masks],
        logprobs=[-np.ones(len(m), np.float32) for m in masks], mask=[np.array(m, np.uint8) for m in masks],
        temperature=np.ones(4, np.float32), reward=np.zeros(4, np.float32), group=np.array([0, 1, 1, 0]),
        agent=["a"] * 4, sample_id=list("abcd"), weight_version=[None] * 4,
    )
    packed = pack_step(seqs, budget=4)  # three micro-batches: the figures are the step's, whatever the packing
    assert len(packed.batches) == 3 and sum(b.num_loss_tokens for b in packed.batches) == 3
    assert source_metrics([0, 1], ("x", "y", "z"), packed) == {  # groups 0 and 1 of sources x and y
        "source/x/groups": 1.0, "source/x/sequences": 2.0, "source/x/tokens": 5.0, "source/x/loss_tokens": 2.0,
        "source/y/groups": 1.0, "source/y/sequences": 2.0, "source/y/tokens": 4.0, "source/y/loss_tokens": 1.0,
        "source/z/groups": 0.0, "source/z/sequences": 0.0, "source/z/tokens": 0.0, "source/z/loss_tokens": 0.0,
    }


# -- one checksum thread for every source ---------------------------------------------------------


def test_one_checksum_thread_hashes_every_source(two, tmp_path, monkeypatch):
    import shutil

    import rollshard.store.loader.stream as stream_mod
    from rollshard.store.common import DataError
    from tests.store.test_integrity import flip

    reads, hashers = [], []
    real_read, real_ranges = stream_mod.read_block, stream_mod.verify_ranges

    def read_block(pf, block, filters, shard, *args, **kw):
        reads.append(shard)
        return real_read(pf, block, filters, shard, *args, **kw)

    def verify_ranges(info, *args):
        hashers.append((info.path, threading.current_thread().name))
        return real_ranges(info, *args)

    monkeypatch.setattr(stream_mod, "read_block", read_block)
    monkeypatch.setattr(stream_mod, "verify_ranges", verify_ranges)
    write(tmp_path / "c", synthetic_table(20, 3, seed=13, uneven_groups=True, **SMALL))
    data = ",".join([*two, str(tmp_path / "c")])
    with MixtureLoader(data, cfg(num_epochs=2)) as loader:
        steps = list(loader)
        assert len({id(st.checksums.thread) for st in loader._streams}) == 1  # the old code: one per source
    # equal weights: c's 2 x 20 groups run out first, having a third of the slots: 12 steps of 10 groups
    assert len(steps) == 12 and collections.Counter(s for st in steps for s in st.group_sources)["c"] == 40
    # blocks are hashed on that thread (a block read ahead when the mixture ends may be dropped unhashed)
    assert hashers and collections.Counter(path for path, _ in hashers) <= collections.Counter(reads)
    assert {name for _, name in hashers} == {"rollshard-checksum-0"}

    # a damaged block of one source stops the mixture with that block's checksum, before a step holds its rows,
    shutil.copytree(two[1], tmp_path / "b")
    shard = sorted((tmp_path / "b" / "shards").glob("*.parquet"))[0]
    flip(shard, "rollout_logprobs", at=0.5)
    data = f"{two[0]}:0.5,{tmp_path / 'b'}:0.5"
    got: list[Step] = []
    # named by its source too: both datasets hold a shards/w0-00000.parquet
    message = (rf"^source b \({re.escape(str(tmp_path / 'b'))}\): shards/{shard.name} \(row group 0, bytes \d+-\d+\): "
               rf"xxh3 [0-9a-f]{{16}}\.\.\. differs from the manifest's")
    with pytest.raises(DataError, match=message):
        with MixtureLoader(data, cfg(groups_per_step=2, shuffle=False)) as loader:
            got.extend(loader)
    assert got == []  # b's first group, in the first step, is in the damaged block

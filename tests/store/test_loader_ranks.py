"""Per-rank reads (store/loader): each rank's share of the blocks, equal steps, the sync callback, resume, open."""

import collections
import json
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rollshard.store.loader.stream as stream_mod
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.loader import SYNC_STEP, LoaderConfig, RolloutLoader, Step
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter, WriterOptions
from tests.store.range_fs import RangeFS
from tests.store.test_loader import assert_steps_equal, delivered, groups_of, rows_of_groups, with_columns

BLOCKS, GROUPS_PER_BLOCK, ROWS = 32, 3, 2  # 96 groups; equal blocks, so the deal gives equal shares
EVEN = dict(prompt_len=(4, 5), response_len=(6, 7))  # every row 10 tokens: every block weighs the same


def write_blocks(path, table: pa.Table, per_block: int = GROUPS_PER_BLOCK, per_shard: int = 4) -> RolloutDataset:
    """One row group per ``per_block`` groups, ``per_shard`` row groups a shard."""
    groups = groups_of(table)
    with ShardWriter(path, writer_id="w0", options=WriterOptions(row_group_bytes=1 << 30)) as w:
        for i in range(0, len(groups), per_block):
            for g in groups[i : i + per_block]:
                w.write_group(g)
            w.flush()
            if (i // per_block) % per_shard == per_shard - 1:
                w.commit()
    return RolloutDataset.open(path)


@pytest.fixture(scope="module")
def even(tmp_path_factory) -> RolloutDataset:
    ds = write_blocks(tmp_path_factory.mktemp("even"), synthetic_table(BLOCKS * GROUPS_PER_BLOCK, ROWS, seed=4, **EVEN))
    assert len(ds.shards) == BLOCKS // 4 and sum(ds.footer(i).num_row_groups for i in range(len(ds.shards))) == BLOCKS
    return ds


def cfg(**kw) -> LoaderConfig:
    base = dict(groups_per_step=4, micro_batch_tokens=64, shuffle_window=5, prefetch=2)
    return LoaderConfig(**{**base, **kw})


class Reads:
    """The blocks each loader reads, recorded where the stream reads one (shard path, row groups)."""

    def __init__(self, monkeypatch):
        self.by_thread: dict[str, list[tuple[str, tuple[int, ...]]]] = collections.defaultdict(list)
        real = stream_mod.read_block

        def read_block(pf, block, filters, shard, check=True, **kw):
            self.by_thread[threading.current_thread().name].append((shard, block.row_groups))
            return real(pf, block, filters, shard, check, **kw)

        monkeypatch.setattr(stream_mod, "read_block", read_block)

    def of_rank(self, rank: int) -> list[tuple[str, tuple[int, ...]]]:
        return self.by_thread[f"rollshard-loader-read-{rank}"]


def all_blocks(ds: RolloutDataset) -> set[tuple[str, tuple[int, ...]]]:
    return {(s.path, (r,)) for i, s in enumerate(ds.shards) for r in range(ds.footer(i).num_row_groups)}


# -- shares ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_reads_only_its_share_and_the_shares_are_the_dataset_once(even, world_size, monkeypatch):
    reads = Reads(monkeypatch)
    all_groups = rows_of_groups(even)
    config = cfg(num_epochs=2)
    per_rank = []
    for r in range(world_size):
        with RolloutLoader(even, config, rank=r, world_size=world_size) as loader:
            per_rank.append(list(loader))
            assert loader.epoch_stats["left_groups"] == loader.epoch_stats["tail_dropped_groups"] == 0
    share = BLOCKS * GROUPS_PER_BLOCK // world_size  # 48 or 24 groups: 12 or 6 steps of 4 an epoch
    assert [len(steps) for steps in per_rank] == [2 * share // 4] * world_size
    for epoch in (0, 1):
        union = epoch_union(per_rank, epoch)
        assert union == all_groups  # together, every group once, whole
    # each rank read only blocks of its share: 32 / world_size blocks an epoch, none read by another rank
    blocks = [reads.of_rank(r) for r in range(world_size)]
    assert [len(b) for b in blocks] == [2 * BLOCKS // world_size] * world_size
    for epoch in (0, 1):
        firsts = [set(b[epoch * BLOCKS // world_size : (epoch + 1) * BLOCKS // world_size]) for b in blocks]
        assert sum(len(f) for f in firsts) == BLOCKS and set().union(*firsts) == all_blocks(even)
    # the loader's own count agrees: 1/world_size of the bytes a single rank reads
    with RolloutLoader(even, cfg()) as one:
        list(one)
        whole = one.read_stats["bytes"]
    for r in range(world_size):
        with RolloutLoader(even, cfg(), rank=r, world_size=world_size) as loader:
            list(loader)
            assert loader.read_stats["blocks"] == BLOCKS // world_size
            assert loader.read_stats["bytes"] <= 1.2 * whole / world_size


def test_small_datasets_share_one_stream_and_take_every_other_group(tmp_path, monkeypatch):
    # 3 blocks for 2 ranks (< 4 a rank): both read every block; rank r takes groups r, r + 2, ... of the
    # one-rank stream, so the two ranks' first steps are the one-rank step of twice the groups
    reads = Reads(monkeypatch)
    ds = write_blocks(tmp_path, synthetic_table(12, ROWS, seed=5, **EVEN), per_block=4)
    whole = [g for s in RolloutLoader(ds, cfg(groups_per_step=4)) for g in s.group_ids]
    reads.by_thread.clear()
    per_rank = [list(RolloutLoader(ds, cfg(groups_per_step=2), rank=r, world_size=2)) for r in range(2)]
    assert [len(steps) for steps in per_rank] == [3, 3]  # 6 groups each
    for r in range(2):
        assert [g for s in per_rank[r] for g in s.group_ids] == whole[r::2]
        assert len(reads.of_rank(r)) == 3  # every block
    got = [delivered(steps) for steps in per_rank]
    assert not got[0].keys() & got[1].keys() and {**got[0], **got[1]} == rows_of_groups(ds)
    assert [s.metrics["groups_examined"] for s in per_rank[1]] == [2.0] * 3  # its own groups only


def epoch_union(per_rank: list[list[Step]], epoch: int) -> dict[str, set[str]]:
    """The groups every rank delivered in ``epoch`` (group id -> sample ids), checking the ranks' are disjoint."""
    union: dict[str, set[str]] = {}
    for steps in per_rank:
        got = delivered([s for s in steps if s.epoch == epoch])
        assert not union.keys() & got.keys()  # disjoint
        union.update(got)
    return union


# -- the agreement callback -----------------------------------------------------------------------


class Agreement:
    """``world_size`` ranks on threads: ``sync(rank)(state)`` waits for every rank, then returns the least state
    (what the trainer's all-reduce with min returns); counts the calls."""

    def __init__(self, world_size: int):
        self.states = [SYNC_STEP] * world_size
        self.calls = [0] * world_size
        self.gather, self.release = threading.Barrier(world_size), threading.Barrier(world_size)

    def sync(self, rank: int):
        def agree(state: int) -> int:
            self.calls[rank] += 1
            self.states[rank] = state
            self.gather.wait(timeout=60)
            least = min(self.states)
            self.release.wait(timeout=60)  # nobody overwrites a state before every rank has read them
            return least

        return agree


def run_ranks(ds, config: LoaderConfig, world_size: int, agreement: Agreement | None, states=None):
    """Every rank's steps and epoch_stats, the ranks iterating at once on threads (as processes would)."""
    out: list = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            sync = agreement.sync(r) if agreement is not None else None
            with RolloutLoader(ds, config, rank=r, world_size=world_size, sync=sync) as loader:
                if states is not None:
                    loader.load_state_dict(states)
                steps = list(loader)
                out[r] = (steps, dict(loader.epoch_stats), loader.state_dict())
        except BaseException as e:  # re-raised below
            errors.append(e)
            if agreement is not None:
                agreement.gather.abort()
                agreement.release.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.fixture(scope="module")
def filtered(tmp_path_factory) -> RolloutDataset:
    """The even dataset with a third of its groups failed (whole), unevenly over the blocks."""
    table = synthetic_table(BLOCKS * GROUPS_PER_BLOCK, ROWS, seed=4, **EVEN)
    gids = table.column("group_id").to_pylist()
    order = list(dict.fromkeys(gids))
    rng = np.random.default_rng(7)
    failed = set(rng.choice(order, size=len(order) // 3, replace=False).tolist())
    status = ["failed" if g in failed else s for g, s in zip(gids, table.column("status").to_pylist())]
    return write_blocks(tmp_path_factory.mktemp("filtered"), with_columns(table, status=status))


@pytest.mark.parametrize("world_size", [2, 4])
def test_sync_ends_each_epoch_on_every_rank_at_the_first_rank_without_a_step(filtered, world_size):
    config = cfg(num_epochs=2)
    alone = run_ranks(filtered, config, world_size, None)  # no callback: each rank runs its own share out
    per_epoch = [[sum(s.epoch == e for s in steps) for steps, _, _ in alone] for e in (0, 1)]
    assert any(len(set(n)) > 1 for n in per_epoch)  # the filters left the ranks different numbers of steps
    agreement = Agreement(world_size)
    synced = run_ranks(filtered, config, world_size, agreement)
    for e in (0, 1):
        m = min(per_epoch[e])
        for r, (steps, _, _) in enumerate(synced):
            mine = [s for s in steps if s.epoch == e]
            assert len(mine) == m  # the same number of steps on every rank: the fewest any rank has
            assert [s.group_ids for s in mine] == [s.group_ids for s in alone[r][0] if s.epoch == e][:m]
    assert len(set(agreement.calls)) == 1  # lockstep: as many calls on every rank
    # the last epoch's counts: what was not delivered is counted, nothing twice
    for r, (steps, stats, _) in enumerate(synced):
        used = sum(len(s.group_ids) for s in steps if s.epoch == 1)
        kept = stats["groups_examined"] - stats["filtered_groups/empty"]
        assert stats["filtered_groups/empty"] > 0
        assert used + stats["tail_dropped_groups"] == kept
        share = RolloutLoader(filtered, config, rank=r, world_size=world_size)._stream.plan(1).shares[r]
        assert stats["groups_examined"] + stats["left_groups"] == share
        assert stats["steps"] == min(per_epoch[1])
    # filter counts are per rank: summed over the ranks they are the epoch's, each group examined once
    total_failed = sum(s["filtered_groups/empty"] for _, s, _ in alone)
    assert total_failed == BLOCKS * GROUPS_PER_BLOCK // 3


def test_resume_mid_epoch_with_sync_continues_every_rank_exactly(filtered):
    world_size, config = 2, cfg(num_epochs=2)
    full = run_ranks(filtered, config, world_size, Agreement(world_size))
    n = len(full[0][0])
    for k in (1, n // 2 - 1, n // 2 + 1, n - 1):  # mid-epoch in both epochs
        cut = cfg(num_epochs=2)
        states = [None] * world_size
        agreement = Agreement(world_size)

        def first_k(r: int) -> None:
            with RolloutLoader(filtered, cut, rank=r, world_size=world_size, sync=agreement.sync(r)) as loader:
                it = iter(loader)
                for _ in range(k):
                    next(it)
                states[r] = json.loads(json.dumps(loader.state_dict()))

        threads = [threading.Thread(target=first_k, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rest = run_ranks(filtered, config, world_size, Agreement(world_size), states=states)
        for r in range(world_size):
            assert_steps_equal(rest[r][0], full[r][0][k:])
            assert rest[r][1] == full[r][1]


def test_a_sync_that_says_yes_without_a_step_is_refused(even):
    with RolloutLoader(even, cfg(), rank=0, world_size=2, sync=lambda state: SYNC_STEP) as loader:
        with pytest.raises(RuntimeError, match="sync callback answered 2 to state 1"):
            list(loader)


# -- open -----------------------------------------------------------------------------------------


def strip_row_groups(root) -> None:
    """Rewrite the manifests as a version-1 writer wrote them: no row groups listed."""
    for path in (root / "_manifests").glob("*.json"):
        doc = json.loads(path.read_text())
        for entry in doc["shards"]:
            entry.pop("row_groups", None)
        doc["manifest_version"] = 1
        path.write_text(json.dumps(doc))


def test_open_reads_no_row_group_with_the_manifest_and_scans_without(tmp_path, monkeypatch):
    ds = write_blocks(tmp_path, synthetic_table(BLOCKS * GROUPS_PER_BLOCK, ROWS, seed=4, **EVEN))
    calls = collections.Counter()
    for name in ("read_row_group", "read_row_groups", "iter_batches", "read"):
        real = getattr(pq.ParquetFile, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(pq.ParquetFile, name, counted)
    new = RolloutLoader(ds, cfg())
    assert sum(calls.values()) == 0  # the manifest's row groups: no row group read
    blocks = new._stream.blocks
    assert len(blocks) == BLOCKS and all(b.weight == GROUPS_PER_BLOCK * ROWS * 10 for b in blocks)  # tokens
    strip_row_groups(tmp_path)
    old_ds = RolloutDataset.open(tmp_path)
    assert all(s.row_groups is None for s in old_ds.shards)
    old = RolloutLoader(old_ds, cfg())
    assert calls["read_row_group"] == BLOCKS  # the old path: each row group's group_id column
    assert [(b.shard, b.row_groups, b.num_groups) for b in old._stream.blocks] == \
        [(b.shard, b.row_groups, b.num_groups) for b in blocks]
    assert_steps_equal(list(old), list(new))  # and the same steps (weights aside, one rank reads all)
    old.close()
    new.close()


def test_manifest_row_groups_must_match_the_file(tmp_path):
    ds = write_blocks(tmp_path, synthetic_table(12, ROWS, seed=5, **EVEN), per_block=4)
    path = next((tmp_path / "_manifests").glob("*.json"))
    doc = json.loads(path.read_text())
    doc["shards"][0]["row_groups"][0]["rows"] += 1
    path.write_text(json.dumps(doc))
    from rollshard.store.common import DataError

    with pytest.raises(DataError, match=f"{ds.shards[0].path}: the manifest lists 3 row groups of 25 rows, the file has "
                                        "3 of 24"):
        RolloutDataset.open(tmp_path)


def test_step_metrics_are_per_rank(even):
    steps = [list(RolloutLoader(even, cfg(), rank=r, world_size=2)) for r in range(2)]
    first: list[Step] = [s[0] for s in steps]
    assert [s.metrics["groups_examined"] for s in first] == [4.0, 4.0]  # this rank's 4, not the global 8
    assert sum(s.metrics["rows_examined"] for s in first) == 2 * 4 * ROWS


def test_validate_checks_the_manifests_row_groups(tmp_path):
    from rollshard.store.io.validate import validate_dataset

    write_blocks(tmp_path, synthetic_table(12, ROWS, seed=5, **EVEN), per_block=4)
    assert validate_dataset(tmp_path).ok
    path = next((tmp_path / "_manifests").glob("*.json"))
    doc = json.loads(path.read_text())
    entry = doc["shards"][0]["row_groups"][1]
    entry["group_hashes"] = entry["group_hashes"][16:] + entry["group_hashes"][:16]  # same ids, another order
    path.write_text(json.dumps(doc))
    report = validate_dataset(tmp_path)
    assert [(p.check, p.detail.split(":")[0]) for p in report.problems] == [("row_groups", "row group 1")]


# -- per-block integrity --------------------------------------------------------------------------


BIG = dict(prompt_len=(20, 40), response_len=(1500, 3000))  # row groups large next to the footers


def open_counted(root) -> tuple[RolloutDataset, RangeFS]:
    from rollshard.store.io.storage import Storage

    fs = RangeFS()
    return RolloutDataset.open(Storage(str(root), filesystem=fs)), fs


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """64 row groups of 4 groups of 8 rows (~400 KB each), 32 a shard; the dataset's root."""
    root = tmp_path_factory.mktemp("big")
    write_blocks(root, synthetic_table(64 * 4, 8, seed=9, **BIG), per_block=4, per_shard=32)
    return root


def damaged_copy(src, dst, path: str, byte: int):
    import shutil

    shutil.copytree(src, dst)
    data = bytearray((dst / path).read_bytes())
    data[byte] ^= 0x40
    (dst / path).write_bytes(bytes(data))
    return dst


def strip_fast_hashes(root) -> None:
    """Rewrite the manifests as a version-3 writer wrote them: byte ranges with their sha256, no XXH3."""
    for path in (root / "_manifests").glob("*.json"):
        doc = json.loads(path.read_text())
        for entry in doc["shards"]:
            assert entry.pop("footer_xxh3") is not None
            for rg in entry["row_groups"]:
                assert rg.pop("xxh3") is not None
        doc["manifest_version"] = 3
        path.write_text(json.dumps(doc))


def test_the_writer_records_each_ranges_xxh3_beside_its_sha256(big):
    import hashlib

    import xxhash

    info = RolloutDataset.open(big).shards[1]
    data = (big / info.path).read_bytes()
    assert info.has_fast_hashes
    for rg in info.row_groups:
        chunk = data[rg.offset : rg.offset + rg.length]
        assert (rg.xxh3, rg.sha256) == (xxhash.xxh3_128(chunk).hexdigest(), hashlib.sha256(chunk).hexdigest())
    tail = data[info.row_groups[-1].offset + info.row_groups[-1].length :]
    assert info.footer_xxh3 == xxhash.xxh3_128(tail).hexdigest()
    assert info.footer_sha256 == hashlib.sha256(tail).hexdigest()


@pytest.mark.parametrize("manifest", ["xxh3", "sha256"])  # version 4 (the XXH3 checked), version 3 (sha256 only)
def test_a_flipped_byte_in_a_ranks_block_is_found_by_that_rank_and_never_read_by_another(big, tmp_path, manifest):
    from rollshard.store.common import DataError

    ds = RolloutDataset.open(big)
    plan = RolloutLoader(ds, cfg(num_epochs=1), rank=1, world_size=2)._stream.plan(0)
    block = plan.piece_block[len(plan.piece_block) // 2]  # one of rank 1's whole blocks, mid-share
    b = RolloutLoader(ds, cfg())._stream.blocks[block]
    info = ds.shards[b.shard]
    rg = info.row_groups[b.row_groups[0]]
    byte = rg.offset + rg.length // 2
    root = damaged_copy(big, tmp_path / "d", info.path, byte)
    if manifest == "sha256":
        strip_fast_hashes(root)
    damaged, fs = open_counted(root)
    assert damaged.shards[b.shard].has_fast_hashes == (manifest == "xxh3")
    with RolloutLoader(damaged, cfg(num_epochs=1), rank=0, world_size=2) as loader:
        assert len(list(loader)) > 0  # rank 0 does not own it: it trains on, and reads nothing of it
    assert fs.reads and not fs.touched(str(root / info.path), byte)
    with pytest.raises(DataError) as error:
        with RolloutLoader(damaged, cfg(num_epochs=1), rank=1, world_size=2) as loader:
            list(loader)
    assert str(error.value).startswith(f"{info.path} (row group {b.row_groups[0]}, bytes {rg.offset}-"
                                       f"{rg.offset + rg.length}): {manifest} ")
    assert "\n" not in str(error.value)


def test_a_rank_whose_loader_raises_releases_the_others_from_the_agreement(big, tmp_path):
    # Only rank 1 owns the damaged block: it raises its DataError, and rank 0, waiting in the agreement for it,
    # raises PeerFailedError at once instead of waiting (a real collective would wait for its timeout).
    from rollshard.store.common import DataError
    from rollshard.store.loader import PeerFailedError

    ds = RolloutDataset.open(big)
    plan = RolloutLoader(ds, cfg(num_epochs=1), rank=1, world_size=2)._stream.plan(0)
    b = RolloutLoader(ds, cfg())._stream.blocks[plan.piece_block[len(plan.piece_block) // 2]]
    info = ds.shards[b.shard]
    rg = info.row_groups[b.row_groups[0]]
    damaged = RolloutDataset.open(damaged_copy(big, tmp_path / "d", info.path, rg.offset + rg.length // 2))
    agreement = Agreement(2)
    errors: list = [None, None]
    steps = [0, 0]

    def rank_main(r: int) -> None:
        try:
            with RolloutLoader(damaged, cfg(num_epochs=1), rank=r, world_size=2, sync=agreement.sync(r)) as loader:
                for _ in loader:
                    steps[r] += 1
        except Exception as e:
            errors[r] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(errors[1], DataError), errors
    assert isinstance(errors[0], PeerFailedError) and "another rank's loader failed" in str(errors[0]), errors
    assert agreement.calls[0] == agreement.calls[1] == steps[0] + 1  # every agreement paired, the last one failing
    assert steps[0] == steps[1] > 0


@pytest.mark.parametrize("manifest", ["xxh3", "sha256"])
def test_a_flipped_byte_in_the_footer_metadata_is_found(big, tmp_path, manifest):
    from rollshard.store.common import DataError

    ds = RolloutDataset.open(big)
    info = ds.shards[0]
    data = (big / info.path).read_bytes()
    at = data.rindex(b"parquet-cpp-arrow")  # created_by: the footer still parses, its bytes differ
    assert at > info.row_groups[-1].offset + info.row_groups[-1].length
    root = damaged_copy(big, tmp_path / "d", info.path, at)
    if manifest == "sha256":
        strip_fast_hashes(root)
    with pytest.raises(DataError, match=rf"^{info.path} \(footer, bytes \d+-{info.bytes}\): {manifest} "):
        with RolloutLoader(root, cfg(num_epochs=1)) as loader:
            list(loader)
    from rollshard.store.io.validate import validate_dataset

    assert [p.check for p in validate_dataset(root).problems] == ["sha256", "ranges"]


def test_a_footer_that_changed_after_the_open_is_found(big, tmp_path):
    # The loader decodes every block with the footer parsed when the dataset was opened: a footer misread (or
    # changed) then and whole again on disk when its sha256 is checked must not decode verified bytes.
    from rollshard.store.common import DataError

    import shutil

    root = shutil.copytree(big, tmp_path / "d")
    info = RolloutDataset.open(big).shards[0]
    good = (big / info.path).read_bytes()
    bad = bytearray(good)
    bad[good.rindex(b"parquet-cpp-arrow")] ^= 0x40  # created_by: the footer still parses, its bytes differ
    (root / info.path).write_bytes(bytes(bad))
    opened = RolloutDataset.open(root)  # parses the changed footer
    (root / info.path).write_bytes(good)  # and the shard is whole again by the time its footer is checked
    with pytest.raises(DataError, match=rf"^{info.path} \(footer\): the footer read when the dataset was opened"):
        with RolloutLoader(opened, cfg(num_epochs=1)) as loader:
            list(loader)
    with RolloutLoader(RolloutDataset.open(root), cfg(num_epochs=1)) as loader:
        assert len(list(loader)) > 0  # opened again: whole


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_bytes_read_per_rank_with_the_checks_on(big, world_size):
    total = sum(s.bytes for s in RolloutDataset.open(big).shards)
    for r in range(world_size):
        ds, fs = open_counted(big)
        with RolloutLoader(ds, cfg(num_epochs=1, verify_data=True), rank=r, world_size=world_size) as loader:
            list(loader)
        assert fs.total() <= 1.2 * total / world_size, (r, fs.total() / total)


def test_validate_catches_a_flipped_byte_in_a_row_group(big, tmp_path):
    from rollshard.store.io.validate import validate_dataset

    info = RolloutDataset.open(big).shards[1]
    rg = info.row_groups[3]
    root = damaged_copy(big, tmp_path / "d", info.path, rg.offset + rg.length // 3)
    problems = validate_dataset(root).problems
    assert [p.check for p in problems][:2] == ["sha256", "ranges"] and "row group 3 " in problems[1].detail


# -- complete epochs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> RolloutDataset:
    """48 blocks of 1 to 7 groups (of uneven tokens), 6 row groups a shard."""
    root = tmp_path_factory.mktemp("uneven")
    sizes = np.random.default_rng(3).integers(1, 8, size=48).tolist()
    groups = groups_of(synthetic_table(sum(sizes), ROWS, seed=11, prompt_len=(2, 30), response_len=(2, 60)))
    with ShardWriter(root, writer_id="w0", options=WriterOptions(row_group_bytes=1 << 30)) as w:
        at = 0
        for i, n in enumerate(sizes):
            for g in groups[at : at + n]:
                w.write_group(g)
            at += n
            w.flush()
            if i % 6 == 5:
                w.commit()
    return RolloutDataset.open(root)


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("tail", ["drop", "partial"])
def test_an_epoch_over_the_ranks_is_every_group_once_but_the_tail(uneven, world_size, tail):
    # the tail: under world_size x groups_per_step groups dropped ("drop"), under world_size ("partial": the
    # ranks' shares are level to a group, and each takes as many steps as the smallest)
    gps = 2
    all_groups = rows_of_groups(uneven)
    config = cfg(groups_per_step=gps, num_epochs=2, tail=tail)
    per_rank, stats = [], []
    for r in range(world_size):
        with RolloutLoader(uneven, config, rank=r, world_size=world_size) as loader:
            steps = list(loader)
            per_rank.append(steps)
            stats.append(loader.epoch_stats)
    assert len({len(steps) for steps in per_rank}) == 1  # the same number of steps on every rank
    for epoch in (0, 1):
        union = epoch_union(per_rank, epoch)
        assert all(all_groups[g] == rows for g, rows in union.items())  # whole groups
        unused = len(all_groups) - len(union)
        assert unused < (world_size * gps if tail == "drop" else world_size), (epoch, unused)  # all but the tail
    unused_last = sum(s["left_groups"] + s["tail_dropped_groups"] for s in stats)  # the last epoch's counts
    assert unused_last == unused


def test_a_state_of_other_groups_per_step_is_refused_above_one_rank(even):
    from rollshard.store.loader import LoaderStateError

    with RolloutLoader(even, cfg(), rank=1, world_size=2) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with pytest.raises(LoaderStateError, match=r"^loader state has groups_per_step=4, this loader groups_per_step=2: "
                                               r"each rank's share of the blocks depends on it"):
        RolloutLoader(even, cfg(groups_per_step=2), rank=1, world_size=2).load_state_dict(state)
    one = RolloutLoader(even, cfg())
    one_state = one.state_dict()
    RolloutLoader(even, cfg(groups_per_step=2)).load_state_dict(one_state)  # one rank: the stream does not depend on it

"""Schema 1.1 sampling supports across the store: written and read back, and 1.0 shards (without the two
columns) mixed with 1.1 ones in one dataset, through every reader."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.derived.derive import derive_dataset
from rollshard.store.common import DataError
from rollshard.store.format.manifest import Manifest, ShardInfo
from rollshard.store.format.schema import (
    META_CONFIG,
    META_SCHEMA_VERSION,
    ADDED_COLUMNS,
    OPTIONAL_COLUMNS,
    ROW_SCHEMA,
    Row,
    RowInvariantError,
    Status,
)
from rollshard.store.io.storage import Storage
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.validate import validate_dataset
from rollshard.store.io.writer import ShardWriter, WriterOptions

SMALL = dict(prompt_len=(2, 6), response_len=(1, 12))
ROW_GROUPS = WriterOptions(row_group_bytes=4_000)  # several row groups per shard


def register_v10_shard(root: Path, writer_id: str, table: pa.Table, row_group_size: int = 4) -> str:
    """A real schema 1.0 shard: a table without the two sampling columns (nor 1.2's routing), schema_version 1.0 in its footer,
    listed in a manifest of its own with the right size, checksum and counts (no rollshard writer)."""
    rel = f"shards/{writer_id}-00000.parquet"
    (root / "shards").mkdir(parents=True, exist_ok=True)
    old = table.drop_columns(list(ADDED_COLUMNS)).replace_schema_metadata(
        {META_SCHEMA_VERSION: b"1.0", META_CONFIG: b"{}"})
    pq.write_table(old, root / rel, row_group_size=row_group_size)
    storage = Storage(root)
    length = lambda c: int(pc.sum(pc.list_value_length(table.column(c))).as_py())  # noqa: E731
    info = ShardInfo(path=rel, rows=table.num_rows, groups=len(pc.unique(table.column("group_id"))),
                     prompt_tokens=length("prompt_tokens"), response_tokens=length("response_tokens"),
                     bytes=storage.size(rel), sha256=storage.sha256(rel), writer_id=writer_id,
                     created_at="2026-01-01T00:00:00.000+00:00")
    Manifest(writer_id=writer_id, shards=[info]).save(storage)
    return rel


def old_table() -> pa.Table:
    return synthetic_table(6, 2, seed=3, prefix="o", **SMALL)


def new_table() -> pa.Table:
    return synthetic_table(6, 2, seed=4, prefix="n", top_k=5, **SMALL)


def plain_table() -> pa.Table:
    return synthetic_table(4, 2, seed=5, prefix="p", **SMALL)  # schema 1.1, no supports (nulls)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """Shards, in path order: a 1.0 shard first (writer a10), then 1.1 with supports (b11), 1.1 without (c11)."""
    root = tmp_path_factory.mktemp("mixed") / "ds"
    register_v10_shard(root, "a10", old_table())
    with ShardWriter(root, writer_id="b11", options=ROW_GROUPS) as w:
        w.write_groups(new_table())
    with ShardWriter(root, writer_id="c11") as w:
        w.write_groups(plain_table())
    return root


def by_id(rows: list[dict]) -> dict[str, dict]:
    return {r["sample_id"]: r for r in rows}


def expected() -> dict[str, dict]:
    return by_id(old_table().to_pylist() + new_table().to_pylist() + plain_table().to_pylist())


def test_the_1_0_shard_is_one_and_the_writer_writes_1_1_with_both_columns(mixed):
    ds = RolloutDataset.open(mixed)
    versions = {s.writer_id: pq.read_schema(mixed / s.path).metadata[META_SCHEMA_VERSION] for s in ds.shards}
    assert versions == {"a10": b"1.0", "b11": b"1.2", "c11": b"1.2"}
    assert "sampling_support" not in pq.read_schema(mixed / ds.shards[0].path).names
    for s in ds.shards[1:]:  # a 1.1 shard always carries both columns, null when unused
        schema = pq.read_schema(mixed / s.path)
        for name in OPTIONAL_COLUMNS:
            assert schema.field(name).type == ROW_SCHEMA.field(name).type


def test_supports_round_trip_through_the_writer_exactly(mixed):
    got = by_id(RolloutDataset.open(mixed).read().to_pylist())
    for sid, row in by_id(new_table().to_pylist()).items():
        assert got[sid]["sampling_support"] == row["sampling_support"]
        assert got[sid]["sampling_logprobs"] == row["sampling_logprobs"]  # float32 both sides: exact
        assert len(row["sampling_support"]) == len(row["response_tokens"]) and len(row["sampling_support"][0]) == 5


def test_read_and_to_arrow_fill_the_1_0_rows_with_nulls(mixed):
    ds = RolloutDataset.open(mixed)
    table = ds.read()
    assert table.schema.remove_metadata().equals(ROW_SCHEMA)
    assert by_id(table.to_pylist()) == expected()  # 1.0 and no-support rows: None in both columns
    assert ds.to_arrow().count_rows() == 32


def test_polars_scan_over_a_1_0_shard_then_1_1_ones(mixed):
    import polars as pl

    df = RolloutDataset.open(mixed).scan().select("sample_id", *OPTIONAL_COLUMNS).collect()
    want = expected()
    assert df.height == len(want)
    for r in df.iter_rows(named=True):
        for name in OPTIONAL_COLUMNS:
            w = want[r["sample_id"]][name]
            assert (r[name] is None) == (w is None)
            if w is not None:
                assert [list(x) for x in r[name]] == w if name == "sampling_support" else list(r[name]) == w
    assert df.schema["sampling_support"] == pl.List(pl.List(pl.Int32))


@pytest.mark.parametrize("streaming", [True, False])
def test_to_hf_with_the_1_0_shard_first(mixed, streaming):
    rows = list(RolloutDataset.open(mixed).to_hf(streaming=streaming))
    want = expected()
    assert len(rows) == len(want)
    for r in rows:
        assert r["sampling_support"] == want[r["sample_id"]]["sampling_support"]
        assert r["sampling_logprobs"] == want[r["sample_id"]]["sampling_logprobs"]


def test_validate_passes_the_mix_and_finds_a_bad_support_in_a_shard(mixed, tmp_path):
    report = validate_dataset(mixed)
    assert report.ok, report.problems
    bad = tmp_path / "bad"
    t = new_table()
    support = t.column("sampling_support").to_pylist()
    support[3][0] = [s + 1 for s in support[3][0] if s != t.column("response_tokens")[3].as_py()[0]] or [0]
    t = t.set_column(t.schema.get_field_index("sampling_support"), ROW_SCHEMA.field("sampling_support"),
                     pa.array(support, ROW_SCHEMA.field("sampling_support").type))
    register_v10_shard(bad, "a10", old_table())
    with ShardWriter(bad, writer_id="b11", options=WriterOptions(validate=False)) as w:
        w.write_groups(t)
    problems = validate_dataset(bad).problems
    assert [(p.check, p.shards) for p in problems] == [("invariant", ("shards/b11-00000.parquet",))]
    assert f"sample {t.column('sample_id')[3].as_py()!r}: sampling_support: token 0 " in problems[0].detail


def test_a_shard_with_one_sampling_column_is_refused_by_validate_and_readers(tmp_path):
    from rollshard.store.loader import LoaderConfig, RolloutLoader

    t = new_table().drop_columns(["sampling_logprobs"]).replace_schema_metadata(
        {META_SCHEMA_VERSION: b"1.1", META_CONFIG: b"{}"})
    rel = register_v10_shard(tmp_path, "w", new_table())
    pq.write_table(t, tmp_path / rel)
    storage = Storage(tmp_path)
    m = Manifest.load(storage, "w")
    m.shards[0] = dataclasses.replace(m.shards[0], bytes=storage.size(rel), sha256=storage.sha256(rel))
    m.save(storage)
    problems = validate_dataset(tmp_path).problems
    assert [p.check for p in problems] == ["schema"]
    assert "lacks columns ['sampling_logprobs']" in problems[0].detail
    with pytest.raises(DataError, match=r"has column 'sampling_support' but not 'sampling_logprobs'; a shard carries "
                                        r"both sampling columns \(schema 1.1\) or neither \(1.0\)"):
        RolloutLoader(tmp_path, LoaderConfig(groups_per_step=1))


def test_derive_of_a_mix_copies_the_1_0_shard_and_rewrites_it_as_1_1(mixed, tmp_path):
    copied = derive_dataset(mixed, tmp_path / "copy", lambda t: t, operation="filter", details={}, progress=False)
    assert copied.rows_out == 32
    ds = RolloutDataset.open(tmp_path / "copy")
    assert by_id(ds.read().to_pylist()) == expected()
    first = ds.shards[0]
    assert pq.read_schema(tmp_path / "copy" / first.path).metadata[META_SCHEMA_VERSION] == b"1.0"  # byte for byte

    def drop_first_group(table: pa.Table) -> pa.Table:
        return table.filter(pc.invert(pc.equal(table.column("group_id"), "op0/policy/0")))

    derive_dataset(mixed, tmp_path / "drop", drop_first_group, operation="filter", details={}, progress=False)
    ds = RolloutDataset.open(tmp_path / "drop")
    versions = sorted(pq.read_schema(tmp_path / "drop" / s.path).metadata[META_SCHEMA_VERSION] for s in ds.shards)
    assert versions == [b"1.2"] * 3  # the 1.0 shard, rewritten by the writer, is a current shard with null supports
    want = {k: v for k, v in expected().items() if not k.startswith("op0-")}
    assert by_id(ds.read().to_pylist()) == want
    assert validate_dataset(tmp_path / "drop").ok


def test_derive_may_not_drop_a_support(mixed, tmp_path):
    from rollshard.store.derived.derive import TransformError

    def drop_supports(table: pa.Table) -> pa.Table:
        return table.drop_columns(list(OPTIONAL_COLUMNS))  # read back as nulls: a change of an immutable column

    with pytest.raises(TransformError, match="changed sampling_logprobs, which must stay byte-identical"):
        derive_dataset(mixed, tmp_path / "out", drop_supports, operation="filter", details={}, progress=False)


def test_the_writer_refuses_a_bad_support_naming_sample_and_field(tmp_path):
    row = Row(sample_id="s0", prompt_id="p", group_id="p/g", agent="policy", round=0, prompt_tokens=[1],
              response_tokens=[5, 6], rollout_logprobs=[-1.0, 0.0], loss_mask=[1, 0], reward=1.0,
              status=Status.COMPLETED, temperature=1.0, sampling_logprobs=[-0.5, 0.0], sampling_support=[[4, 7], []])
    with ShardWriter(tmp_path, writer_id="w") as w:
        with pytest.raises(RowInvariantError, match=r"^sample 's0': sampling_support: token 0 \(id 5\) is not in its "
                                                    r"support \[4, 7\]"):
            w.write_group([row])
        w.write_group([Row(**{**row.to_dict(), "status": Status.COMPLETED, "sampling_support": [[4, 5], []]})])
    assert RolloutDataset.open(tmp_path).read().column("sampling_support").to_pylist() == [[[4, 5], []]]


def test_stats_report_the_rows_with_a_support(mixed):
    from rollshard.store.inspection.stats import dataset_stats

    st = dataset_stats(RolloutDataset.open(mixed))
    assert st["rows_with_support"] == 12 and st["support_fraction"] == pytest.approx(12 / 32)


def test_synthetic_supports_hold_the_sampled_token_once_each():
    t = synthetic_table(3, 4, seed=0, top_k=20)
    resp = np.concatenate(t.column("response_tokens").to_numpy(zero_copy_only=False))
    sup = np.asarray(pc.list_flatten(pc.list_flatten(t.column("sampling_support")))).reshape(-1, 20)
    assert (sup == resp[:, None]).sum(axis=1).tolist() == [1] * len(resp)
    assert (np.diff(sup, axis=1) > 0).all()  # ascending, so distinct


# -- the loader -------------------------------------------------------------------------------


def loader_config(**kw):
    from rollshard.store.loader import LoaderConfig

    return LoaderConfig(**{"groups_per_step": 2, "micro_batch_tokens": 24, "seed": 3, **kw})


def check_against_stored(steps, stored: dict[str, dict]) -> tuple[int, int]:
    """Every packed position's support fields against the stored rows; (micro-batches with, without supports)."""
    import torch

    with_sup = without = 0
    for step in steps:
        for b in step.micro_batches:
            if b.has_support is None:
                without += 1
                assert b.sampling_logprobs is None and b.support_ids is None and b.support_offsets is None
                assert all(stored[sid]["sampling_support"] is None for sid in b.sample_ids)
                continue
            with_sup += 1
            cu, off = b.cu_seqlens.tolist(), b.support_offsets.tolist()
            assert off[0] == 0 and off[-1] == len(b.support_ids) and len(off) == b.num_tokens + 1
            for k, sid in enumerate(b.sample_ids):
                row, start = stored[sid], int(b.response_start[k])
                for t in range(cu[k], cu[k + 1]):
                    i = t - start  # response position, negative in the prompt
                    on = i >= 0 and bool(b.loss_mask[t] == 1) and row["sampling_support"] is not None
                    assert bool(b.has_support[t]) == on, (sid, t)
                    want = row["sampling_support"][i] if on else []
                    assert b.support_ids[off[t] : off[t + 1]].tolist() == want, (sid, t)
                    assert b.sampling_logprobs[t].item() == (row["sampling_logprobs"][i] if on else 0.0)
                    if on:
                        assert int(b.input_ids[t]) in want  # the target of position t is in its support
            assert b.sampling_logprobs.dtype == torch.float32 and b.support_ids.dtype == torch.int64
    return with_sup, without


def test_loader_steps_carry_the_stored_supports_over_a_mix(mixed):
    from rollshard.store.loader import RolloutLoader

    ds = RolloutDataset.open(mixed)
    with RolloutLoader(ds, loader_config(num_epochs=2)) as loader:
        steps = list(loader)
    with_sup, without = check_against_stored(steps, by_id(ds.read().to_pylist()))
    assert with_sup and without  # micro-batches of the 1.1 rows with supports, and of the 1.0 / plain rows
    assert sum(s.num_sequences for s in steps) == 2 * 32


def test_loader_resume_is_exact_with_supports(mixed):
    from tests.store.test_loader import assert_steps_equal, run

    ds = RolloutDataset.open(mixed)
    cfg = loader_config(num_epochs=2)
    full = run(ds, cfg)
    from rollshard.store.loader import RolloutLoader

    with RolloutLoader(ds, cfg) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(5)]
        state = loader.state_dict()
    assert_steps_equal(head + run(ds, cfg, state=state), full)  # every field, the four support tensors included
    assert any(b.has_support is not None for s in full for b in s.micro_batches)


def test_a_1_0_dataset_loads_with_none_support_fields(tmp_path):
    from rollshard.store.loader import RolloutLoader

    register_v10_shard(tmp_path, "a10", old_table())
    with RolloutLoader(tmp_path, loader_config()) as loader:
        batches = [b for s in loader for b in s.micro_batches]
    assert batches and all(
        (b.sampling_logprobs, b.has_support, b.support_ids, b.support_offsets) == (None,) * 4 for b in batches)


def test_the_loader_refuses_a_bad_support_naming_shard_sample_and_field(tmp_path):
    from rollshard.store.loader import RolloutLoader

    t = new_table()
    lp = t.column("sampling_logprobs").to_pylist()
    lp[5][0] = 0.5  # above 0: no probability is > 1
    t = t.set_column(t.schema.get_field_index("sampling_logprobs"), ROW_SCHEMA.field("sampling_logprobs"),
                     pa.array(lp, ROW_SCHEMA.field("sampling_logprobs").type))
    with ShardWriter(tmp_path, writer_id="w", options=WriterOptions(validate=False)) as w:
        w.write_groups(t)
    sid = t.column("sample_id")[5].as_py()
    with pytest.raises(DataError, match=rf"^shards/w-00000.parquet \(row group 0\): sample {sid!r}: sampling_logprobs: "
                                        r"token 0 has sampling logprob 0.5 under loss_mask 1"):
        with RolloutLoader(tmp_path, loader_config()) as loader:
            list(loader)


def test_hf_groups_carry_the_supports(mixed):
    from rollshard.store.loader import hf_groups

    stored = expected()
    n = 0
    for g in hf_groups(mixed, loader_config()):
        for sid, lp, sup in zip(g["sample_id"], g["sampling_logprobs"], g["sampling_support"]):
            assert sup == stored[sid]["sampling_support"] and lp == stored[sid]["sampling_logprobs"]
            n += 1
    assert n == 32


def test_inspect_sample_shows_sampling_logprob_and_support_size_per_token(mixed, capsys):
    import json

    from rollshard.store.commands import main

    row = new_table().slice(0, 1).to_pylist()[0]
    assert main(["inspect", str(mixed), "--sample", row["sample_id"], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(t["sampling_logprob"], t["support_size"]) for t in doc["tokens"]] == [
        (lp, 5) for lp in row["sampling_logprobs"]]
    assert "sampling_support" not in doc["sample"] and "sampling_logprobs" not in doc["sample"]
    old = old_table().slice(0, 1).to_pylist()[0]["sample_id"]
    assert main(["inspect", str(mixed), "--sample", old, "--json"]) == 0
    assert all("support_size" not in t for t in json.loads(capsys.readouterr().out)["tokens"])
    assert main(["inspect", str(mixed), "--sample", row["sample_id"]]) == 0
    text = capsys.readouterr().out
    assert "sampling logprob" in text and "5-5 ids per token (mask 1)" in text
    assert main(["stats", str(mixed)]) == 0
    assert "rows with a sampling support" in capsys.readouterr().out

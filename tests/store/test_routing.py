"""Schema 1.2 routed experts: the bytes layout, the invariants at the writer and in validate, the loader's packing."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.store.format.routing import RoutingShape, RoutingShapeError
from rollshard.store.format.invariants import check_table
from rollshard.store.format.schema import Row, RowInvariantError, Status, rows_to_table
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.validate import validate_dataset
from rollshard.store.io.writer import ShardWriter, WriterOptions

from .test_sampling import register_v10_shard

SHAPE = RoutingShape(layers=2, top_k=2, experts=4)


def _ids(positions: int, seed: int) -> np.ndarray:  # [positions, 2, 2] distinct experts per (position, layer)
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.permutation(4)[:2] for _ in range(2)]) for _ in range(positions)]).astype(np.uint8)


def _row(i: int, group: str = "g0", *, P: int = 3, R: int = 4, routed: bytes | None | str = "ok", seed: int = 0) -> Row:
    if routed == "ok":
        routed = SHAPE.encode(_ids(P + R - 1, seed + i))
    return Row(sample_id=f"{group}/{i}", prompt_id=group, group_id=group, agent="policy", round=0,
               prompt_tokens=list(range(10, 10 + P)), response_tokens=list(range(20, 20 + R)),
               rollout_logprobs=[-0.5] * R, loss_mask=[1] * R, reward=float(i), status=Status.COMPLETED,
               temperature=1.0, routed_experts=routed)


def test_shape_types_and_round_trip():
    assert SHAPE.dtype == np.uint8 and SHAPE.width == 4 and SHAPE.bytes_per_position == 4
    wide = RoutingShape(layers=3, top_k=8, experts=384)  # over 256 experts: two bytes, little-endian
    assert wide.dtype == np.dtype("<u2") and wide.bytes_per_position == 48
    ids = np.arange(5 * 3 * 8).reshape(5, 3, 8) % 384
    assert np.array_equal(wide.decode(wide.encode(ids)), ids)
    assert np.array_equal(SHAPE.decode(SHAPE.encode(ids[:, :2, :2] % 4)), ids[:, :2, :2] % 4)
    flat = _ids(3, 1).reshape(3, 4)  # an SGLang client's [positions, layers x top_k]
    assert SHAPE.encode(flat) == SHAPE.encode(flat.reshape(3, 2, 2))
    with pytest.raises(RoutingShapeError, match=r"must lie in \[0, 4\)"):
        SHAPE.encode(np.full((1, 2, 2), 4))
    with pytest.raises(RoutingShapeError, match=r"\[positions, 2, 2\]"):
        SHAPE.encode(np.zeros((1, 3, 2)))
    assert RoutingShape.from_config({}) is None
    with pytest.raises(RoutingShapeError, match="expected"):
        RoutingShape.from_config({"routed_experts": {"layers": 2}})


def test_every_break_is_named_with_its_numbers():
    dup, big, zero = _ids(6, 1), _ids(6, 2), _ids(6, 3)
    dup[1, 0] = [1, 1]
    big[0, 1, 0] = 9
    zero[2, 1] = [0, 0]  # a top-2 of zeros: a layer the capture never wrote
    rows = [_row(0), _row(1, routed=SHAPE.encode(_ids(6, 1))[:-1]), _row(2, routed=dup.tobytes()),
            _row(3, routed=big.tobytes()), _row(4, routed=None), _row(5, routed=zero.tobytes())]
    got = {p.sample_id: p.detail for p in check_table(rows_to_table(rows), routing=SHAPE)}
    assert got == {
        "g0/1": "holds 23 bytes; 6 positions (prompt + response - 1) x 2 layers x top-2 x 1 byte(s) is 24",
        "g0/2": "names one expert twice in a top-k of one position and layer; a top-k picks distinct experts",
        "g0/3": "holds an expert id >= 4, the model's expert count",
        "g0/5": "has a top-k of all expert 0 at a position and layer: the routing was not captured there",
    }
    # Top-1 routing may send every token of a row to expert 0 in a layer: valid.
    one = RoutingShape(layers=2, top_k=1, experts=4)
    assert check_table(rows_to_table([_row(0, routed=np.zeros((6, 2, 1), np.uint8).tobytes())]), routing=one) == []
    # Routing without a shape to read it by: refused; a table without routing needs none.
    assert "names no routing shape" in check_table(rows_to_table([_row(0)]))[0].detail
    assert check_table(rows_to_table([_row(0, routed=None)])) == []


def test_writer_refuses_and_validate_finds(tmp_path):
    config = {"routed_experts": SHAPE.to_config()}
    bad = _row(1, routed=SHAPE.encode(_ids(6, 1))[:-4])  # one position short
    with ShardWriter(tmp_path / "a", config=config) as w:
        with pytest.raises(RowInvariantError, match="holds 20 bytes"):
            w.write_group([_row(0), bad])
        w.write_group([_row(0), _row(1)])
    assert validate_dataset(str(tmp_path / "a")).ok
    with ShardWriter(tmp_path / "b", config=config, options=WriterOptions(validate=False)) as w:
        w.write_group([_row(0), bad])
    report = validate_dataset(str(tmp_path / "b"))
    assert not report.ok and "holds 20 bytes" in str(report.to_dict())


def test_loader_packs_each_rows_positions_and_leaves_the_last_free(tmp_path):
    rows = [_row(0, "a", P=3, R=4), _row(1, "a", P=2, R=5, routed=None), _row(0, "b", P=5, R=1)]
    with ShardWriter(tmp_path / "ds", config={"routed_experts": SHAPE.to_config()}) as w:
        w.write_group(rows[:2])
        w.write_group(rows[2:])
    ds = RolloutDataset.open(tmp_path / "ds")
    cfg = LoaderConfig(groups_per_step=2, micro_batch_tokens=4096, shuffle=False, routed_experts=True)
    (step,) = list(RolloutLoader(ds, cfg))
    (mb,) = step.micro_batches
    cu = mb.cu_seqlens.tolist()
    by_id = {r.sample_id: r for r in rows}
    for k, sid in enumerate(mb.sample_ids):
        row, (start, end) = by_id[sid], cu[k : k + 2]
        valid = mb.routed_valid[start:end].numpy()
        if row.routed_experts is None:
            assert not valid.any() and not mb.routed_experts[start:end].any()
            continue
        n = end - start - 1  # P + R - 1 stored positions, then the row's last, never forwarded by the engine
        assert valid.tolist() == [True] * n + [False]
        assert np.array_equal(mb.routed_experts[start : start + n].numpy(), SHAPE.decode(row.routed_experts).reshape(n, 4))
    # Not asked for: not read.
    (step,) = list(RolloutLoader(ds, LoaderConfig(groups_per_step=2, shuffle=False)))
    assert step.micro_batches[0].routed_experts is None


def test_a_shard_without_the_column_reads_as_before(tmp_path):
    root = tmp_path / "ds"
    register_v10_shard(root, "a10", synthetic_table(4, 2, seed=3, prefix="o", prompt_len=(2, 5), response_len=(2, 6)))
    assert "routed_experts" not in pq.read_schema(next((root / "shards").glob("*.parquet"))).names
    ds = RolloutDataset.open(root)
    assert ds.read().column("routed_experts").null_count == 8
    steps = list(RolloutLoader(ds, LoaderConfig(groups_per_step=2, shuffle=False, routed_experts=True)))
    assert steps and all(mb.routed_experts is None for st in steps for mb in st.micro_batches)


def test_hf_groups_carry_the_routing_when_asked(tmp_path):
    from rollshard.store.loader.hf import hf_groups

    rows = [_row(0, "a"), _row(1, "a", routed=None)]
    with ShardWriter(tmp_path / "ds", config={"routed_experts": SHAPE.to_config()}) as w:
        w.write_group(rows)
    (group,) = list(hf_groups(tmp_path / "ds", LoaderConfig(routed_experts=True)))
    stored = SHAPE.decode(rows[0].routed_experts).reshape(-1, 4).tolist()
    assert dict(zip(group["sample_id"], group["routed_experts"])) == {"a/0": stored, "a/1": None}
    (group,) = list(hf_groups(tmp_path / "ds"))
    assert group["routed_experts"] == [None, None]

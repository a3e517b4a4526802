"""RowFilter on a hand-built table (each filter's worked result), its lineage details, and filter_dataset end to end."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.derived.filter import RowFilter, filter_dataset, parse_list, parse_weight_versions, read_sample_ids
from rollshard.store.format.lineage import lineage_of
from rollshard.store.format.schema import ROW_SCHEMA, Row, Status, rows_to_table
from rollshard.store.io.writer import ShardWriter

#   sample  group  agent     status     reward  weight_version
#   a0      g0     solver    completed  1.0     3
#   a1      g0     solver    completed  0.0     4
#   a2      g0     solver    failed     None    5
#   b0      g1     rewriter  truncated  0.5     v7
#   b1      g1     rewriter  completed  0.25    10
TABLE_ROWS = [
    ("a0", "g0", "solver", Status.COMPLETED, 1.0, "3"),
    ("a1", "g0", "solver", Status.COMPLETED, 0.0, "4"),
    ("a2", "g0", "solver", Status.FAILED, None, "5"),
    ("b0", "g1", "rewriter", Status.TRUNCATED, 0.5, "v7"),
    ("b1", "g1", "rewriter", Status.COMPLETED, 0.25, "10"),
]


def row(sid, group, agent, status, reward, wv) -> Row:
    n = 0 if status is Status.FAILED else 3
    return Row(sample_id=sid, prompt_id=group, group_id=group, agent=agent, round=0, prompt_tokens=[1, 2],
               response_tokens=[5] * n, rollout_logprobs=[-0.5] * n, loss_mask=[1] * n, reward=reward, status=status,
               weight_version=wv, temperature=1.0, created_at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc))


@pytest.fixture
def table() -> pa.Table:
    return rows_to_table([row(*r) for r in TABLE_ROWS])


def kept(f: RowFilter, table: pa.Table) -> list[str]:
    return f(table).column("sample_id").to_pylist()


def test_each_filter_keeps_exactly_its_rows(table):
    assert kept(RowFilter(agents=("solver",)), table) == ["a0", "a1", "a2"]
    assert kept(RowFilter(statuses=("truncated", "failed")), table) == ["a2", "b0"]
    assert kept(RowFilter(min_reward=0.25), table) == ["a0", "b0", "b1"]  # a2 has no reward: dropped
    assert kept(RowFilter(max_reward=0.25), table) == ["a1", "b1"]
    assert kept(RowFilter(min_reward=0.25, max_reward=0.5), table) == ["b0", "b1"]
    assert kept(RowFilter(weight_versions=("4", "v7")), table) == ["a1", "b0"]
    assert kept(RowFilter(weight_version_range=(4, 10)), table) == ["a1", "a2", "b1"]  # "v7" is no integer
    assert kept(RowFilter(weight_version_range=(5, None)), table) == ["a2", "b1"]
    assert kept(RowFilter(weight_version_range=(None, 3)), table) == ["a0"]
    assert kept(RowFilter(sample_ids=frozenset({"b1", "a1", "zz"})), table) == ["a1", "b1"]
    # all given filters must pass
    assert kept(RowFilter(agents=("solver",), min_reward=0.5), table) == ["a0"]
    f = RowFilter(agents=("rewriter",), statuses=("completed",), weight_version_range=(0, 100))
    assert kept(f, table) == ["b1"]


def test_a_reward_range_drops_an_infinite_reward(table):
    inf = rows_to_table([row("c0", "g2", "solver", Status.FAILED, float("inf"), "1")])  # only failed may be inf
    assert kept(RowFilter(min_reward=0.0), inf) == [] and kept(RowFilter(max_reward=1e30), inf.slice(0)) == []
    assert kept(RowFilter(statuses=("failed",)), inf) == ["c0"]


def test_a_filter_that_every_row_passes_returns_the_table_itself(table):
    assert RowFilter(agents=("solver", "rewriter"))(table) is table  # what lets derive copy the shard


def test_details_and_expression():
    f = RowFilter(agents=("solver", "policy"), min_reward=0.5, weight_version_range=(3, 5),
                  sample_ids=frozenset({"x", "y"}))
    assert f.expression() == ("agent in [policy, solver] and reward >= 0.5 and weight_version >= 3 and "
                              "weight_version <= 5 and sample_id in (2 ids)")
    d = f.details()
    assert d["expression"] == f.expression()
    assert d["filters"]["agent"] == ["policy", "solver"] and d["filters"]["weight_version_range"] == [3, 5]
    assert d["filters"]["sample_ids"]["count"] == 2
    # the id set's identity does not depend on the order of the lines
    assert RowFilter(sample_ids=frozenset(["y", "x"])).details()["filters"]["sample_ids"] == d["filters"]["sample_ids"]
    assert RowFilter(sample_ids=frozenset(["x"])).details()["filters"]["sample_ids"]["sha256"] != (
        d["filters"]["sample_ids"]["sha256"])


@pytest.mark.parametrize(
    "kw, message",
    [
        ({}, "no filter given"),
        ({"statuses": ("done",)}, "status 'done' is not one of completed, truncated, aborted, failed"),
        ({"min_reward": 1.0, "max_reward": 0.0}, "min_reward 1.0 is above max_reward 0.0"),
        ({"min_reward": float("nan")}, "min_reward must be a finite number"),
        ({"weight_version_range": (5, 3)}, "range 5..3 is empty"),
        ({"weight_version_range": (None, None)}, "needs a bound"),
        ({"weight_versions": ("1",), "weight_version_range": (1, 2)}, "not both"),
        ({"agents": ()}, "agents must list one or more"),
    ],
)
def test_bad_filters_are_refused(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        RowFilter(**kw)


def test_parsers(tmp_path):
    assert parse_list("solver, rewriter", "--agent") == ("solver", "rewriter")
    with pytest.raises(ValueError, match="none empty"):
        parse_list("solver,,x", "--agent")
    assert parse_weight_versions("3,4") == (("3", "4"), None)
    assert parse_weight_versions("3..5") == (None, (3, 5))
    assert parse_weight_versions("3..") == (None, (3, None))
    assert parse_weight_versions("..5") == (None, (None, 5))
    with pytest.raises(ValueError, match="LO..HI of integers"):
        parse_weight_versions("a..5")
    ids = tmp_path / "ids.txt"
    ids.write_text("a0\n\n  b1  \na0\n")
    assert read_sample_ids(ids) == frozenset({"a0", "b1"})
    ids.write_text("\n\n")
    with pytest.raises(ValueError, match="no ids in the file"):
        read_sample_ids(ids)
    with pytest.raises(ValueError, match="cannot read it"):
        read_sample_ids(tmp_path / "missing.txt")


def test_filter_dataset_reward_range_keeps_part_of_a_group_in_one_shard(table, tmp_path):
    with ShardWriter(tmp_path / "p", writer_id="w0") as w:
        w.write_groups(table.slice(0, 3))  # g0
        w.commit()
        w.write_groups(table.slice(3, 2))  # g1
    res = filter_dataset(tmp_path / "p", tmp_path / "out", RowFilter(min_reward=0.25), progress=False)
    # g0 keeps a0 only (a1 0.0, a2 no reward); g1 keeps both: its shard is copied
    assert (res.rows_out, res.shards_rewritten, res.shards_copied, res.shards_dropped) == (3, 1, 1, 0)
    d = RolloutDataset.open(tmp_path / "out")
    assert sorted(d.read().column("sample_id").to_pylist()) == ["a0", "b0", "b1"]
    assert [(s.rows, s.groups) for s in d.shards] == [(1, 1), (2, 1)]  # the part of g0 left is one group
    [entry] = lineage_of(d)
    assert entry["operation"] == "filter"
    assert entry["details"] == {"filters": {"min_reward": 0.25}, "expression": "reward >= 0.25"}
    assert d.read().schema.equals(ROW_SCHEMA, check_metadata=False)

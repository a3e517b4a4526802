"""derive_dataset: copies, rewrites and drops per shard, the immutable-column check, lineage, resume, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import rollshard.store.derived.derive as derive_mod
from rollshard.store.commands import main
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.derived.derive import STATE_FILE, DeriveError, TransformError, derive_dataset
from rollshard.store.common import DataError
from rollshard.store.format.lineage import lineage_of
from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.store.format.schema import ROW_SCHEMA, RowInvariantError
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter

SMALL = dict(prompt_len=(2, 6), response_len=(3, 12))
TOKEN_COLUMNS = ("prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask")
# 7 groups of 4 rows; group g is agent AGENTS[g], its rows are 4g..4g+3
AGENTS = ("solver", "solver", "solver", "rewriter", "rewriter", "rewriter", "solver")
CONFIG_W0 = {"sampling": {"max_new_tokens": 12}, "agents": {"name": "multi_agent"}, "engine": {"model": "m0"}}
CONFIG_W1 = {"sampling": {"max_new_tokens": 24}, "agents": {"name": "multi_agent"}, "engine": {"model": "m0"}}


def groups(table: pa.Table, *gs: int) -> pa.Table:
    return pa.concat_tables([table.slice(4 * g, 4) for g in gs])


def build_parent(root: Path) -> Path:
    """Writer w0: shard 0 = [g0 g1] (one row group), shard 1 = [g2 | g3] (two row groups), shard 2 = [g4 g5];
    writer w1: shard 0 = [g6]. Keeping the solvers: w0 shard 0 and w1 shard 0 pass whole (copied), w0 shard 1
    keeps its first row group (rewritten), w0 shard 2 keeps nothing (dropped)."""
    t = synthetic_table(7, 4, agents=AGENTS, seed=3, **SMALL)
    with ShardWriter(root, writer_id="w0", config=CONFIG_W0) as w:
        w.write_groups(groups(t, 0, 1))
        w.commit()
        w.write_groups(groups(t, 2))
        w.flush()
        w.write_groups(groups(t, 3))
        w.commit()
        w.write_groups(groups(t, 4, 5))
    with ShardWriter(root, writer_id="w1", config=CONFIG_W1) as w:
        w.write_groups(groups(t, 6))
    return root


@pytest.fixture
def parent(tmp_path) -> Path:
    return build_parent(tmp_path / "parent")


def keep_solvers(table: pa.Table) -> pa.Table:
    keep = pc.equal(table["agent"], "solver")
    return table if pc.all(keep).as_py() else table.filter(keep)


def derive_solvers(parent, out, **kw):
    return derive_dataset(parent, out, keep_solvers, operation="filter", details={"agent": ["solver"]},
                          progress=False, **kw)


def sorted_rows(path) -> pa.Table:
    return RolloutDataset.open(path).read().sort_by("sample_id")


def test_filter_by_agent_copies_rewrites_and_drops(parent, tmp_path):
    out = tmp_path / "out"
    res = derive_solvers(parent, out)
    # rows: 28 in; solvers g0 g1 g2 g6 = 16 kept
    assert (res.rows_in, res.rows_out, res.rows_dropped, res.rows_changed) == (28, 16, 12, 0)
    assert (res.shards_copied, res.shards_rewritten, res.shards_dropped, res.shards_resumed) == (2, 1, 1, 0)
    assert res.summary() == "kept 16 of 28 rows (12 dropped); shards: 2 copied, 1 rewritten, 1 dropped"

    p, d = RolloutDataset.open(parent), RolloutDataset.open(out)
    by_path = {s.path: s for s in p.shards}
    assert [(s.path, s.rows, s.groups) for s in d.shards] == [
        ("shards/filter.w0-00000.parquet", 8, 2),  # copy of w0-00000
        ("shards/filter.w0-00001.parquet", 4, 1),  # w0-00001 rewritten: g2 only
        ("shards/filter.w1-00000.parquet", 4, 1),  # copy of w1-00000
    ]
    copied, rewritten, copied_w1 = d.shards
    assert copied.sha256 == by_path["shards/w0-00000.parquet"].sha256
    assert (out / copied.path).read_bytes() == (parent / "shards/w0-00000.parquet").read_bytes()
    assert copied_w1.sha256 == by_path["shards/w1-00000.parquet"].sha256
    assert rewritten.sha256 != by_path["shards/w0-00001.parquet"].sha256
    assert pq.ParquetFile(out / rewritten.path).metadata.num_row_groups == 1  # one per parent row group kept

    want = p.read().filter(pc.equal(p.read()["agent"], "solver")).sort_by("sample_id")
    got = sorted_rows(out)
    assert got.column("sample_id").to_pylist() == want.column("sample_id").to_pylist()
    assert got.equals(want)  # every column, the token ones included, equal to the parent's
    for name in TOKEN_COLUMNS:
        assert got.column(name).equals(want.column(name)), name


def test_lineage_and_configs_mirror_the_parent_writers(parent, tmp_path):
    out = tmp_path / "out"
    derive_solvers(parent, out, command="rollshard-store filter parent --agent solver")
    p, d = RolloutDataset.open(parent), RolloutDataset.open(out)
    [entry] = lineage_of(d)
    assert entry["operation"] == "filter"
    assert entry["parent"] == str(parent.resolve())
    assert entry["parent_fingerprint"] == p.fingerprint
    assert entry["details"] == {"agent": ["solver"]}
    assert entry["mutable_columns"] == []
    assert entry["command"] == "rollshard-store filter parent --agent solver"
    assert lineage_of(out) == lineage_of(d.manifests) == [entry]
    assert lineage_of(parent) == []
    # one writer per parent writer, each with its parent writer's generation settings at the top level
    configs = {m.writer_id: m.config for m in d.manifests}
    assert sorted(configs) == ["filter.w0", "filter.w1"]
    for wid, parent_config in (("filter.w0", CONFIG_W0), ("filter.w1", CONFIG_W1)):
        c = configs[wid]
        assert {k: c[k] for k in parent_config} == parent_config
        assert c["derived"]["parent_writer"] == wid.split(".", 1)[1]
        assert c["lineage"] == [c["derived"]]
    # rewritten shards carry the derived config in their footer; copies keep the parent's
    footer = {s.path: RolloutDataset.open(out).parquet_file(s).schema_arrow.metadata for s in d.shards}
    rewritten = json.loads(footer["shards/filter.w0-00001.parquet"][b"rollshard.config"])
    assert rewritten == configs["filter.w0"]
    assert json.loads(footer["shards/filter.w0-00000.parquet"][b"rollshard.config"]) == CONFIG_W0

    # a derive of the derived: the lineage grows, newest first
    out2 = tmp_path / "out2"
    derive_dataset(out, out2, lambda t: t, operation="copy", details={}, progress=False)
    lineage = lineage_of(out2)
    assert [e["operation"] for e in lineage] == ["copy", "filter"]
    assert lineage[0]["parent"] == str(out.resolve()) and lineage[1] == entry
    assert RolloutDataset.open(out2).manifests[0].config["sampling"] == CONFIG_W0["sampling"]


class Crash(Exception):
    pass


def test_resume_after_a_crash_in_the_transform(parent, tmp_path):
    calls = {"n": 0}

    def crashing(table):
        calls["n"] += 1
        if table.column("agent")[0].as_py() == "solver" and table.column("group_id")[0].as_py().startswith("p2/"):
            raise Crash("killed while on the second shard")
        return keep_solvers(table)

    out = tmp_path / "out"
    with pytest.raises(Crash):
        derive_dataset(parent, out, crashing, operation="filter", details={"agent": ["solver"]}, progress=False)
    assert [s.path for s in RolloutDataset.open(out).shards] == ["shards/filter.w0-00000.parquet"]  # shard 1 done

    res = derive_solvers(parent, out)
    assert res.shards_resumed == 1
    assert (res.rows_out, res.shards_copied, res.shards_rewritten, res.shards_dropped) == (16, 2, 1, 1)
    whole = tmp_path / "whole"
    derive_solvers(parent, whole)
    got, want = sorted_rows(out), sorted_rows(whole)
    assert got.num_rows == 16 and len(set(got.column("sample_id").to_pylist())) == 16  # no duplicate
    assert got.equals(want)
    # the same shards (a rewritten one's footer holds its derive's created_at, so only copies match byte for byte)
    shards = {s.path: s for s in RolloutDataset.open(out).shards}
    assert [(p, s.rows) for p, s in shards.items()] == [(s.path, s.rows) for s in RolloutDataset.open(whole).shards]
    parent_sha = {s.sha256 for s in RolloutDataset.open(parent).shards}
    assert [p for p, s in shards.items() if s.sha256 in parent_sha] == [
        "shards/filter.w0-00000.parquet", "shards/filter.w1-00000.parquet"]
    # a rerun of a finished derive does nothing and says the same
    again = derive_solvers(parent, out)
    assert again.shards_resumed == 4 and again.summary().startswith("kept 16 of 28 rows")


@pytest.mark.parametrize("where", ["after the rewrite's commit", "after the copy's rename"])
def test_resume_after_a_kill_between_commit_and_record(parent, tmp_path, monkeypatch, where):
    """The output is committed (or renamed, not yet in the manifest) but the state does not say so: the rerun
    attributes it to the parent shard in flight instead of deriving that shard again."""
    out = tmp_path / "out"
    if where == "after the rewrite's commit":
        real_end = derive_mod.DeriveState.end

        def end(self, output):
            if output == "shards/filter.w0-00001.parquet":
                raise Crash(where)
            real_end(self, output)

        monkeypatch.setattr(derive_mod.DeriveState, "end", end)
    else:
        real_commit = derive_mod.PendingFile.commit

        def commit(self):
            result = real_commit(self)
            if self.rel == "shards/filter.w1-00000.parquet":
                raise Crash(where)  # renamed into place, the manifest not yet saved
            return result

        monkeypatch.setattr(derive_mod.PendingFile, "commit", commit)
    with pytest.raises(Crash):
        derive_solvers(parent, out)
    monkeypatch.undo()
    state = json.loads((out / STATE_FILE).read_text())
    assert state["current"] is not None  # the kill left the shard in flight recorded

    res = derive_solvers(parent, out)
    got = sorted_rows(out)
    assert got.num_rows == 16 and len(set(got.column("sample_id").to_pylist())) == 16
    assert got.equals(sorted_rows(_whole(parent, tmp_path)))
    assert (res.shards_copied, res.shards_rewritten, res.shards_dropped) == (2, 1, 1)
    assert len(RolloutDataset.open(out).shards) == 3


def _whole(parent, tmp_path) -> Path:
    whole = tmp_path / "whole"
    derive_solvers(parent, whole)
    return whole


def _set_first(table: pa.Table, name: str, value) -> pa.Table:
    col = table.column(name).to_pylist()
    col[0] = value(col[0])
    field = ROW_SCHEMA.field(name)
    return table.set_column(table.schema.get_field_index(name), field, pa.array(col, field.type))


@pytest.mark.parametrize(
    "name, change",
    [
        ("response_tokens", lambda v: [v[0] + 1, *v[1:]]),
        ("rollout_logprobs", lambda v: [v[0] - 0.5, *v[1:]]),
        ("loss_mask", lambda v: [0, *v[1:]]),
        ("prompt_tokens", lambda v: v[:-1]),
        ("created_at", lambda v: v.replace(year=2000)),
        ("group_id", lambda v: v + "x"),
        ("reward", lambda v: 1.0 - v),  # not mutable unless the operation says so
    ],
)
def test_a_transform_that_changes_an_immutable_column_is_refused(parent, tmp_path, name, change):
    def tamper(table):
        return _set_first(table, name, change) if table.column("sample_id")[0].as_py() == "p2-solver-0-0" else table

    with pytest.raises(TransformError) as e:
        derive_dataset(parent, tmp_path / "out", tamper, operation="rescore", details={}, progress=False)
    msg = str(e.value)
    assert "'p2-solver-0-0'" in msg and f"changed {name}," in msg and "shards/w0-00001.parquet" in msg
    assert "\n" not in msg


def test_a_negative_zero_logprob_is_a_change(tmp_path):
    """Byte-identical, not float-equal: a tool token's logprob 0.0 -> -0.0 passes the row invariants (it is zero)
    and compares equal as a float, but it is another stored value."""
    t = synthetic_table(2, 2, seed=4, **SMALL)
    t = _set_first(t, "loss_mask", lambda v: [0, *v[1:]])
    t = _set_first(t, "rollout_logprobs", lambda v: [0.0, *v[1:]])
    with ShardWriter(tmp_path / "p", writer_id="w0") as w:
        w.write_groups(t)

    def negative_zero(table):
        return _set_first(table, "rollout_logprobs", lambda v: [-0.0, *v[1:]])

    with pytest.raises(TransformError, match=r"sample 'p0-policy-0-0': the rescore transform changed rollout_logprobs"):
        derive_dataset(tmp_path / "p", tmp_path / "out", negative_zero, operation="rescore", details={},
                       mutable_columns=("reward",), progress=False)


def test_mutable_columns_change_and_the_rest_stays(parent, tmp_path):
    """A rescore-like transform: reward -> 1 - reward on the solvers of p2 only."""
    def rescore(table):
        if not table.column("group_id")[0].as_py().startswith("p2/"):
            return table
        return table.set_column(table.schema.get_field_index("reward"), ROW_SCHEMA.field("reward"),
                                pc.subtract(pa.scalar(1.0, pa.float32()), table["reward"]))

    out = tmp_path / "out"
    res = derive_dataset(parent, out, rescore, operation="rescore", details={"reward": "flip"},
                         mutable_columns=("reward", "metadata"), progress=False)
    assert (res.rows_out, res.rows_changed, res.rows_dropped) == (28, 4, 0)
    # only w0 shard 1 changed (its first row group): rewritten; the other three copied
    assert (res.shards_copied, res.shards_rewritten, res.shards_dropped) == (3, 1, 0)
    assert res.summary() == "kept 28 of 28 rows (0 dropped, 4 changed); shards: 3 copied, 1 rewritten, 0 dropped"
    p, d = sorted_rows(parent), sorted_rows(out)
    for name in ROW_SCHEMA.names:
        if name != "reward":
            assert d.column(name).equals(p.column(name)), name
    flipped = [1.0 - r if s.startswith("p2-") else r
               for s, r in zip(p.column("sample_id").to_pylist(), p.column("reward").to_pylist())]
    assert d.column("reward").to_pylist() == flipped
    assert lineage_of(out)[0]["mutable_columns"] == ["metadata", "reward"]


def test_a_transform_that_adds_or_repeats_a_row_is_refused(parent, tmp_path):
    def repeat(table):
        return pa.concat_tables([table, table.slice(0, 1)])

    with pytest.raises(TransformError, match=r"returned sample 'p0-solver-0-0' twice"):
        derive_dataset(parent, tmp_path / "a", repeat, operation="x", details={}, progress=False)

    def add(table):
        return _set_first(table, "sample_id", lambda v: "new-id")

    with pytest.raises(TransformError, match=r"returned sample 'new-id', which is not in this row group"):
        derive_dataset(parent, tmp_path / "b", add, operation="x", details={}, progress=False)


def test_a_transformed_row_that_breaks_an_invariant_is_refused_by_the_writer(parent, tmp_path):
    def no_reward(table):
        return table.set_column(table.schema.get_field_index("reward"), ROW_SCHEMA.field("reward"),
                                pa.nulls(table.num_rows, pa.float32()))

    with pytest.raises(RowInvariantError, match=r"^sample 'p0-solver-0-0': reward: is None"):
        derive_dataset(parent, tmp_path / "out", no_reward, operation="rescore", details={},
                       mutable_columns=("reward",), progress=False)


def test_refusals(parent, tmp_path):
    out = tmp_path / "out"
    derive_solvers(parent, out)
    with pytest.raises(DeriveError, match=r"holds a filter derive with other details \(\{\"agent\": \[\"solver\"\]\} "
                                          r"there, \{\"agent\": \[\"rewriter\"\]\} now\)"):
        derive_dataset(parent, out, keep_solvers, operation="filter", details={"agent": ["rewriter"]}, progress=False)
    with pytest.raises(DeriveError, match="holds a filter derive with other operation"):
        derive_dataset(parent, out, keep_solvers, operation="rescore", details={"agent": ["solver"]}, progress=False)
    with pytest.raises(DeriveError, match="other mutable_columns"):
        derive_solvers(parent, out, mutable_columns=("reward",))
    other = build_parent(tmp_path / "other")
    with pytest.raises(DeriveError, match=f"was derived from {parent.resolve()}, not {other.resolve()}"):
        derive_solvers(other, out)
    with pytest.raises(DeriveError, match="is the parent"):
        derive_solvers(parent, parent)
    with pytest.raises(DeriveError, match="is inside the parent"):
        derive_solvers(parent, parent / "shards" / "x")
    with pytest.raises(DeriveError, match=r"exists and is not a derive \(it holds _manifests, _tmp, shards\)"):
        derive_solvers(parent, other)
    for bad in ("sample_id", "tokens"):
        with pytest.raises(ValueError, match=bad):
            derive_solvers(parent, tmp_path / "never", mutable_columns=(bad,))
    assert not (tmp_path / "never").exists()


def test_a_parent_changed_since_a_partial_derive_is_refused(parent, tmp_path):
    def crash_on_p2(table):
        if table.column("group_id")[0].as_py().startswith("p2/"):
            raise Crash("killed")
        return keep_solvers(table)

    out = tmp_path / "out"
    with pytest.raises(Crash):
        derive_dataset(parent, out, crash_on_p2, operation="filter", details={"agent": ["solver"]}, progress=False)
    before = RolloutDataset.open(parent).fingerprint
    with ShardWriter(parent, writer_id="w2") as w:
        w.write_groups(synthetic_table(1, 2, seed=9, prefix="late", **SMALL))
    after = RolloutDataset.open(parent).fingerprint
    with pytest.raises(DeriveError, match=f"changed since the derive into .* began \\(fingerprint {before} then, "
                                          f"{after} now\\)"):
        derive_solvers(parent, out)
    # and a derive that did not finish is no parent
    with pytest.raises(DeriveError, match="is a filter derive that did not finish"):
        derive_solvers(out, tmp_path / "grandchild")


def test_derived_dataset_validates_and_loads(parent, tmp_path):
    out = tmp_path / "out"
    derive_solvers(parent, out)
    assert main(["validate", str(out), "--no-progress"]) == 0

    def group_ids(ds, **kw):
        config = LoaderConfig(groups_per_step=1, micro_batch_tokens=64, shuffle=False, tail="partial", **kw)
        with RolloutLoader(ds, config) as loader:
            return sorted(g for step in loader for g in step.group_ids), None

    got, _ = group_ids(RolloutDataset.open(out))
    want, _ = group_ids(RolloutDataset.open(parent), agents=("solver",))
    assert got == want == ["p0/solver/0", "p1/solver/0", "p2/solver/0", "p6/solver/0"]


@pytest.mark.parametrize("shard", ["shards/w0-00000.parquet", "shards/w0-00001.parquet"], ids=["copy", "rewrite"])
def test_a_parent_shard_not_its_manifests_sha256_is_refused(parent, tmp_path, shard):
    manifest = parent / "_manifests" / "w0.json"
    doc = json.loads(manifest.read_text())
    for s in doc["shards"]:
        if s["path"] == shard:
            s["sha256"] = "0" * 64
    manifest.write_text(json.dumps(doc))
    with pytest.raises(DataError, match=f"^{shard}: sha256 .* differs from the manifest's 0000000000000000"):
        derive_solvers(parent, tmp_path / "out")
    assert not any(s.sha256 == "0" * 64 for s in RolloutDataset.open(tmp_path / "out").shards)

"""store/inspection/audit.py: the summary's numbers on a table worked out by hand, the worst tokens, the file."""

from __future__ import annotations

import math
import os

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from rollshard.store.inspection import audit
from rollshard.store.inspection.audit import (AUDIT_SCHEMA, AuditedDataset, AuditSchemaError, audited_datasets, check_destination,
                                   read_audit, summarize, worst_tokens, write_audit)

# Six tokens; every logprob is a binary fraction, so r = trainer - rollout is exact in float32 and float64.
#   sample agent     version T    pos  rollout  trainer   r        |r|     exp(r)  outside [0.9, 1.1]
#   s1     solver    0       1.0  0    -1.0     -1.0       0       0       1       no
#   s1     solver    0       1.0  15   -2.0     -1.75     +0.25    0.25    1.284   yes
#   s1     solver    0       1.0  16   -0.5     -1.0      -0.5     0.5     0.607   yes
#   s2     rewriter  1       0.7  63   -3.0     -2.875    +0.125   0.125   1.133   yes
#   s2     rewriter  1       0.7  64   -1.0     -1.0625   -0.0625  0.0625  0.939   no
#   s3     selector  (null)  0.0  300  -4.0     -2.0      +2.0     2.0     7.389   yes
TOKENS = [
    ("s1", "solver", "0", 1.0, 0, -1.0, -1.0),
    ("s1", "solver", "0", 1.0, 15, -2.0, -1.75),
    ("s1", "solver", "0", 1.0, 16, -0.5, -1.0),
    ("s2", "rewriter", "1", 0.7, 63, -3.0, -2.875),
    ("s2", "rewriter", "1", 0.7, 64, -1.0, -1.0625),
    ("s3", "selector", None, 0.0, 300, -4.0, -2.0),
]
# k3 = exp(r) - 1 - r per token: 0, e^0.25 - 1.25 = 0.0340254167, e^-0.5 - 0.5 = 0.1065306597,
# e^0.125 - 1.125 = 0.0081484531, e^-0.0625 - 0.9375 = 0.0019130628, e^2 - 3 = 4.3890560989.
K3 = [0.0, 0.034025416687741505, 0.10653065971263342, 0.008148453066826322, 0.0019130628134757868, 4.38905609893065]
TIGHT = 1e-12
DATA = [AuditedDataset(source="data", uri="/runs/data", fingerprint="0123456789abcdef")]


def table(tokens=TOKENS, source: str = "data") -> pa.Table:
    cols = list(zip(*tokens))
    return pa.table(
        {
            "sample_id": cols[0], "group_id": [f"g-{s}" for s in cols[0]], "agent": cols[1],
            "source": [source] * len(tokens), "weight_version": pa.array(cols[2], pa.string()),
            "temperature": pa.array(cols[3], pa.float32()), "position": pa.array(cols[4], pa.int32()),
            "token": pa.array(range(len(tokens)), pa.int32()), "rollout_logprob": pa.array(cols[5], pa.float32()),
            "trainer_logprob": pa.array(cols[6], pa.float32()),
        },
        schema=AUDIT_SCHEMA,
    )


def test_overall_numbers_worked_by_hand():
    o = summarize(table())["overall"]
    assert o["tokens"] == 6 and o["sequences"] == 3
    # mean |r| = (0 + 0.25 + 0.5 + 0.125 + 0.0625 + 2) / 6 = 2.9375 / 6
    assert o["mean"] == pytest.approx(2.9375 / 6, abs=TIGHT)
    assert o["max"] == 2.0
    # sorted |r|: 0, 0.0625, 0.125, 0.25, 0.5, 2.0; linear quantile q sits at index 5q:
    # p50 at 2.5 -> (0.125 + 0.25) / 2; p90 at 4.5 -> (0.5 + 2) / 2; p99 at 4.95 -> 0.5 + 0.95 * 1.5
    assert o["p50"] == pytest.approx(0.1875, abs=TIGHT)
    assert o["p90"] == pytest.approx(1.25, abs=TIGHT)
    assert o["p99"] == pytest.approx(1.925, abs=TIGHT)
    assert o["ratio_outside"] == pytest.approx(4 / 6, abs=TIGHT)  # r = 0.25, -0.5, 0.125, 2
    assert o["k3"] == pytest.approx(sum(K3) / 6, abs=TIGHT)  # 0.7566122819


def test_groups_worked_by_hand():
    s = summarize(table())
    agents = s["by_agent"]
    assert list(agents) == ["rewriter", "selector", "solver"]
    assert agents["solver"]["mean"] == pytest.approx(0.25, abs=TIGHT)  # (0 + 0.25 + 0.5) / 3
    assert agents["solver"]["p50"] == pytest.approx(0.25, abs=TIGHT)
    assert agents["solver"]["ratio_outside"] == pytest.approx(2 / 3, abs=TIGHT)
    assert agents["solver"]["k3"] == pytest.approx(sum(K3[:3]) / 3, abs=TIGHT)
    assert agents["rewriter"]["mean"] == pytest.approx(0.09375, abs=TIGHT)  # (0.125 + 0.0625) / 2
    assert agents["rewriter"]["max"] == 0.125 and agents["rewriter"]["ratio_outside"] == 0.5
    assert agents["selector"] == {**agents["selector"], "tokens": 1, "max": 2.0, "p99": 2.0, "ratio_outside": 1.0}
    # Buckets by response position: 0-15 holds positions 0 and 15; 16-63: 16 and 63; 64-255: 64; 256+: 300.
    pos = s["by_position"]
    assert list(pos) == ["0-15", "16-63", "64-255", "256+"]
    assert [pos[k]["tokens"] for k in pos] == [2, 2, 1, 1]
    assert [pos[k]["mean"] for k in pos] == pytest.approx([0.125, 0.3125, 0.0625, 2.0], abs=TIGHT)
    # Temperatures by value, as their float32 shortest decimals (0.7 is stored as 0.699999988).
    temps = s["by_temperature"]
    assert list(temps) == ["0.0", "0.7", "1.0"]
    assert [temps[k]["max"] for k in temps] == [2.0, 0.125, 0.5]
    versions = s["by_weight_version"]
    assert list(versions) == ["0", "1", audit.UNKNOWN_VERSION]  # integers by value, a row without one last
    assert [versions[k]["sequences"] for k in versions] == [1, 1, 1]
    assert list(s["by_source"]) == ["data"]


def test_sequences_are_counted_per_source():
    """Two rounds of the same prompts (rollshard-loop reuses the ids): s1, s2, s3 of each are 6 sequences."""
    both = pa.concat_tables([table(source="r0"), table(source="r1")])
    s = summarize(both)
    assert s["overall"]["tokens"] == 12 and s["overall"]["sequences"] == 6
    assert [s["by_source"][k]["sequences"] for k in ("r0", "r1")] == [3, 3]
    assert s["by_agent"]["solver"]["sequences"] == 2  # s1 of r0 and s1 of r1
    # equal |r| in both rounds: the tie broken by source after the sample id
    w = worst_tokens(both, 2)
    assert list(zip(w["source"], w["sample_id"], w["position"])) == [("r0", "s3", 300), ("r1", "s3", 300)]


def test_versions_sort_as_integers():
    rows = [(f"s{v}", "policy", str(v), 1.0, 0, -1.0, -1.0) for v in (10, 9, 2)]
    assert list(summarize(table(rows))["by_weight_version"]) == ["2", "9", "10"]


def test_k3_clamps_the_log_ratio_inside_the_exp_only():
    # r = +30: exp is taken of the clamp, 20; k3 = e^20 - 1 - 30 (the trainer's mismatch/k3_kl, losses.py).
    rows = [("s", "policy", "0", 1.0, 0, -30.0, 0.0)]
    o = summarize(table(rows))["overall"]
    assert o["k3"] == pytest.approx(math.expm1(20.0) - 30.0, rel=TIGHT)
    assert o["max"] == 30.0


def test_empty_report():
    s = summarize(table().slice(0, 0))
    assert s["overall"]["tokens"] == 0 and s["overall"]["mean"] is None
    assert s["by_agent"] == {}


def test_worst_tokens_order_and_ties():
    w = worst_tokens(table(), 3)
    assert list(zip(w["sample_id"], w["position"])) == [("s3", 300), ("s1", 16), ("s1", 15)]
    assert w["diff"].to_list() == [2.0, -0.5, 0.25]
    assert w["ratio"].to_list() == pytest.approx([math.exp(2.0), math.exp(-0.5), math.exp(0.25)], rel=TIGHT)
    # Equal |r|: by sample id, then position.
    tied = [("b", "policy", "0", 1.0, 3, -1.0, -1.5), ("a", "policy", "0", 1.0, 7, -1.0, -0.5),
            ("a", "policy", "0", 1.0, 2, -1.0, -1.5)]
    w = worst_tokens(table(tied), 10)
    assert list(zip(w["sample_id"], w["position"])) == [("a", 2), ("a", 7), ("b", 3)]


def test_contexts_from_the_rows():
    class Chars:  # a tokenizer whose token i is the character chr(97 + i)
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i) for i in ids)

    rows = pa.table({"sample_id": ["s3"], "prompt_tokens": [[0, 1]], "response_tokens": [list(range(2, 12))]})
    worst = worst_tokens(table([("s3", "selector", None, 0.0, 4, -4.0, -2.0)]), 1)
    worst = worst.with_columns(token=worst["token"] * 0 + 6)  # response position 4 is token 6, "g"
    (c,) = audit.token_contexts(rows, worst, Chars())
    # ids: a b | c d e f g h i j k l; "g" is at 2 + 4 = 6, the 8 before are "abcdef" (all there are), 3 after "hij"
    assert (c["before"], c["text"], c["after"]) == ("abcdef", "g", "hij")
    assert c["sample_id"] == "s3" and c["diff"] == 2.0
    (none,) = audit.token_contexts(rows.slice(0, 0), worst, Chars())
    assert none["before"] is None and none["text"] == "g"


def test_write_read_roundtrip(tmp_path):
    path = tmp_path / "audit.parquet"
    assert write_audit(table(), path, datasets=DATA, metadata={"model": "m"}) == os.fspath(path)
    back = read_audit(path)
    assert back.equals(table().cast(back.schema))
    assert audit.report_metadata(back)["model"] == "m"
    assert audit.report_metadata(back)["rollshard.audit_schema_version"] == audit.AUDIT_SCHEMA_VERSION == "1.1"
    assert audited_datasets(back) == DATA
    assert os.listdir(tmp_path) == ["audit.parquet"]  # no temporary file left


def test_the_datasets_audited_are_named(tmp_path):
    from rollshard.store.io.dataset import RolloutDataset
    from rollshard.store.synthetic import synthetic_table
    from rollshard.store.io.writer import ShardWriter

    with ShardWriter(tmp_path / "r0", writer_id="w", config={}) as w:
        w.write_groups(synthetic_table(1, 2, prompt_len=(2, 3), response_len=(2, 3)))
    ds = RolloutDataset.open(os.path.relpath(tmp_path / "r0"))
    entry = AuditedDataset.of("r0", ds)
    assert entry == AuditedDataset(source="r0", uri=str(tmp_path / "r0"), fingerprint=ds.fingerprint)  # absolute
    with pytest.raises(ValueError, match="source\\(s\\) data of the report are not in datasets"):
        write_audit(table(), tmp_path / "a.parquet", datasets=[entry])  # every source must be named
    assert not (tmp_path / "a.parquet").exists()
    # a report of schema 1.0 names none; one whose entry is damaged is refused in one line
    old = tmp_path / "old.parquet"
    pq.write_table(table().replace_schema_metadata({"rollshard.audit_schema_version": "1.0"}), old)
    assert audited_datasets(read_audit(old)) is None
    bad = tmp_path / "bad.parquet"
    pq.write_table(table().replace_schema_metadata({"rollshard.audit_schema_version": "1.1",
                                                    "rollshard.audit_datasets": '[{"source": "data"}]'}), bad)
    with pytest.raises(AuditSchemaError, match="unreadable rollshard.audit_datasets") as e:
        read_audit(bad)
    assert "\n" not in str(e.value)


def test_check_destination_local(tmp_path):
    check_destination(tmp_path / "a.parquet")  # a new file in an existing folder
    with pytest.raises(ValueError, match=f"--out {tmp_path} is a folder; name the report file"):
        check_destination(tmp_path)
    with pytest.raises(ValueError, match="no folder .*/no; create it first"):
        check_destination(tmp_path / "no" / "a.parquet")
    with pytest.raises(ValueError, match="no folder .*/no; create it first"):
        check_destination((tmp_path / "no" / "a.parquet").as_uri())


def test_check_destination_s3(s3_dataset):
    bucket = s3_dataset.rsplit("/", 1)[0]
    check_destination(f"{bucket}/reports/audit.parquet")  # a prefix with no key yet: the bucket is what must exist
    write_audit(table(), f"{bucket}/reports/audit.parquet", datasets=DATA)
    with pytest.raises(ValueError, match=r"--out s3://\S+/reports is a folder"):
        check_destination(f"{bucket}/reports")
    with pytest.raises(ValueError, match="--out s3://no-such-bucket-here/a.parquet: no bucket no-such-bucket-here"):
        check_destination("s3://no-such-bucket-here/a.parquet")
    with pytest.raises(ValueError, match="names no file"):
        check_destination(bucket)


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "audit.parquet"
    write_audit(table(), path, datasets=DATA)
    before = path.read_bytes()

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_audit(table().slice(0, 2), path, datasets=DATA)
    assert path.read_bytes() == before  # the old report intact
    assert os.listdir(tmp_path) == ["audit.parquet"]  # and the temporary file removed


def test_read_refuses_newer_major_and_foreign_files(tmp_path):
    newer = tmp_path / "newer.parquet"
    t = table()
    pq.write_table(t.replace_schema_metadata({"rollshard.audit_schema_version": "2.0"}), newer)
    with pytest.raises(AuditSchemaError, match=r"audit schema 2\.0, this rollshard reads 1\.x; upgrade") as e:
        read_audit(newer)
    assert "\n" not in str(e.value)
    minor = tmp_path / "minor.parquet"
    pq.write_table(t.replace_schema_metadata({"rollshard.audit_schema_version": "1.7"}), minor)
    assert read_audit(minor).num_rows == 6  # a newer minor adds columns at most: read
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"x": [1]}), foreign)
    with pytest.raises(AuditSchemaError, match="not an audit report"):
        read_audit(foreign)
    text = tmp_path / "text.parquet"
    text.write_text("hello")
    with pytest.raises(AuditSchemaError, match="not a Parquet file"):
        read_audit(text)
    with pytest.raises(FileNotFoundError):
        read_audit(tmp_path / "missing.parquet")


def test_s3_roundtrip(s3_dataset):
    uri = s3_dataset.rsplit("/", 1)[0] + "/reports/audit.parquet"
    write_audit(table(), uri, datasets=DATA)
    assert read_audit(uri).num_rows == 6
    fs, root = pafs.FileSystem.from_uri(uri.rsplit("/", 1)[0])
    names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(root))]
    assert names == ["audit.parquet"]  # uploaded under a temporary key, moved, the temporary one gone

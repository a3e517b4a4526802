"""rollshard-train on a damaged shard: one line naming the shard and the problem, exit 2, no optimizer step.

One test per kind of damage, with the shards of tests/store/test_integrity.py (written around the
writer and registered in a manifest): the dataset holds only the bad shard, so any step the trainer
took would have been on bad data. The loader's own tests check the messages in full and that a clean
shard before a bad one still trains.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from rollshard.store.format.schema import rows_to_table
from rollshard.train.cli import main

from tests.store.test_integrity import BAD, dataset, flip, row


def _retype(column: str, to: pa.DataType):
    def build() -> pa.Table:
        table = rows_to_table([row("b-0"), row("b-1")])
        return table.set_column(table.schema.get_field_index(column), column, table.column(column).cast(to))

    return build


def _status(value: str):
    def build() -> pa.Table:
        table = rows_to_table([row("b-0"), row("b-1")])
        return table.set_column(table.schema.get_field_index("status"), "status", pa.array(["completed", value]))

    return build


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-20])


# (kind, bad rows or a table builder, damage before the manifest records the file, damage after, expected text)
CASES = [
    ("nan logprob", [row("b-0"), row("b-1", logprobs=(-0.1, float("nan"), -0.3))], None, None,
     "sample 'b-1': rollout_logprobs: token 1 has logprob nan under loss_mask 1"),
    ("positive logprob", [row("b-0", logprobs=(-0.1, -0.2, 0.5)), row("b-1")], None, None,
     "sample 'b-0': rollout_logprobs: token 2 has logprob 0.5 under loss_mask 1"),
    ("int64 ids", _retype("response_tokens", pa.list_(pa.int64())), None, None,
     "column 'response_tokens' is list<int64>, expected list<int32>"),
    ("double logprobs", _retype("rollout_logprobs", pa.list_(pa.float64())), None, None,
     "column 'rollout_logprobs' is list<double>, expected list<float>"),
    ("unknown status", _status("done"), None, None, "sample 'b-1': status: 'done' is not one of completed"),
    ("flipped byte", None, None, lambda p: flip(p, "response_text", at=0.9),
     "differs from the manifest's"),
    ("misaligned logprobs", [row("b-0", logprobs=(-0.1, -0.2)), row("b-1")], None, None,
     "sample 'b-0': rollout_logprobs: length 2 and loss_mask length 3 must both equal response_tokens length 3"),
    ("negative token id", [row("b-0"), row("b-1", tokens=(1, -5, 3))], None, None,
     "sample 'b-1': response_tokens: token ids must be non-negative"),
    ("missing column", lambda: rows_to_table([row("b-0"), row("b-1")]).drop(["rollout_logprobs"]), None, None,
     "lacks column 'rollout_logprobs'"),
    ("truncated footer", None, _truncate, None, "not readable as Parquet"),
    ("schema 2.0", None, None, None, "written with rollshard schema 2.0, this rollshard reads schema 1.x"),
]


@pytest.mark.parametrize("kind, bad, before, after, expected", CASES, ids=[c[0] for c in CASES])
def test_a_damaged_shard_stops_training_before_any_step(kind, bad, before, after, expected, tiny_gpt2, tmp_path,
                                                        capsys):
    rows = bad if isinstance(bad, list) else None
    table = bad() if callable(bad) else None
    root = dataset(tmp_path / "ds", rows, table=table, damage=before,
                   schema_version="2.0" if kind == "schema 2.0" else "1.0")
    (root / "_manifests" / "a.json").unlink()  # the bad shard alone: any step would hold its rows
    (root / "shards" / "a-00000.parquet").unlink()
    if after is not None:
        after(root / BAD)
    out = tmp_path / "run"
    argv = ["--data", root, "--model", tiny_gpt2, "--out", out, "--groups-per-step", "1", "--tail", "partial",
            "--no-progress", "--no-tensorboard"]  # fmt: skip
    assert main(list(map(str, argv))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rollshard-train: error: ") and BAD in err and expected in err, err
    assert not (out / "checkpoints").exists()
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()

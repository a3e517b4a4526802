import glob

import pyarrow.compute as pc
import pytest

from rollshard.store.io.dataset import DatasetNotFoundError, RolloutDataset
from rollshard.store.common import DataError
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter, WriterOptions

SMALL = dict(prompt_len=(3, 9), response_len=(2, 30))


@pytest.fixture
def dataset(tmp_path):
    table = synthetic_table(12, 3, seed=11, agents=("solver", "rewriter"), **SMALL)
    with ShardWriter(tmp_path, writer_id="w0", options=WriterOptions(row_group_bytes=3_000, shard_bytes=6_000)) as w:
        for start in range(0, table.num_rows, 3):
            w.write_group(table.slice(start, 3))
    return tmp_path, table


def test_counts_come_from_manifests(dataset):
    path, table = dataset
    ds = RolloutDataset.open(path)
    assert ds.num_rows == 36
    assert ds.num_groups == 12
    assert ds.num_response_tokens == pc.sum(pc.list_value_length(table["response_tokens"])).as_py()
    assert ds.num_tokens == ds.num_response_tokens + pc.sum(pc.list_value_length(table["prompt_tokens"])).as_py()
    assert len(ds.fingerprint) == 16


def test_scans_agree(dataset):
    path, table = dataset
    ds = RolloutDataset.open(path)
    assert ds.to_arrow().count_rows() == 36
    lf = ds.scan()
    by_agent = dict(lf.group_by("agent").len().collect().iter_rows())
    assert by_agent == {"solver": 18, "rewriter": 18}
    hf_rows = list(ds.to_hf(streaming=True))
    assert sorted(r["sample_id"] for r in hf_rows) == sorted(table["sample_id"].to_pylist())


def test_standard_readers_need_no_rollshard_code(dataset):
    path, table = dataset
    files = sorted(glob.glob(str(path / "shards" / "*.parquet")))
    assert len(files) > 1
    expected_tokens = sorted(table["response_tokens"].to_pylist())

    import datasets

    streamed = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    assert sorted(r["response_tokens"] for r in streamed) == expected_tokens

    import polars as pl

    df = pl.scan_parquet(str(path / "shards" / "*.parquet")).select("sample_id", "rollout_logprobs").collect()
    assert df.height == 36
    got = dict(zip(df["sample_id"].to_list(), df["rollout_logprobs"].to_list()))
    want = dict(zip(table["sample_id"].to_pylist(), table["rollout_logprobs"].to_pylist()))
    assert got == want

    import pyarrow.dataset as pads

    assert pads.dataset(str(path / "shards"), format="parquet").count_rows() == 36

    duckdb = pytest.importorskip("duckdb")
    [(n, tokens)] = duckdb.connect().execute(
        f"select count(*), sum(len(response_tokens)) from read_parquet('{path}/shards/*.parquet')"
    ).fetchall()
    assert (n, tokens) == (36, sum(len(t) for t in expected_tokens))


def test_missing_dataset_is_one_clear_error(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="no rollshard dataset here .* check the path"):
        RolloutDataset.open(tmp_path / "nope")


def test_open_checks_every_shard_not_only_the_first(dataset):
    path, _ = dataset
    shards = RolloutDataset.open(path).shards
    assert len(shards) > 1
    (path / shards[-1].path).unlink()
    with pytest.raises(DataError) as info:
        RolloutDataset.open(path)
    assert str(info.value) == (f"{shards[-1].path}: the manifest lists this shard but the file is not there; "
                               "run `rollshard-store validate` on the dataset for every problem")

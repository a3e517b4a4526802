"""A damaged or foreign shard never reaches a step: one test per kind of damage, each through the loader.

Every dataset here is writer ``a``'s clean shard (written by ShardWriter; its groups sort first)
plus writer ``b``'s bad shard, written around the writer and registered in a manifest of its own
with the right size and checksum (as tests/store/test_validate.py builds its damage). The loader
reads shards in path order (no shuffle) with a one-group window, so every step of ``a`` is handed
on before ``b`` is read; each test then requires a DataError naming ``b``'s shard, the row and the
problem, and no step holding a row of ``b``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollshard.store.io import integrity
from rollshard.store.commands import main
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.loader import DataError, LoaderConfig, RolloutLoader, Step, hf_groups
from rollshard.store.format.manifest import Manifest, ShardInfo
from rollshard.store.format.schema import (META_CONFIG, META_SCHEMA_VERSION, SCHEMA_VERSION, Row, SchemaVersionError, Status,
                                    rows_to_table)
from rollshard.store.io.storage import Storage
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter

BAD = "shards/b-00000.parquet"
VALIDATE = "run `rollshard-store validate` on the dataset for every problem"
CLEAN_GROUPS = 4
RGS = "(row groups 0, 1)"  # b's one group, a row per row group: the block the loader reads


def row(sid: str, *, tokens=(1, 2, 3), logprobs=(-0.1, -0.2, -0.3), mask=(1, 1, 1), status=Status.COMPLETED) -> Row:
    return Row(sample_id=sid, prompt_id="bp", group_id="bp/solver/0", agent="solver", round=0,
               prompt_tokens=[7, 8], response_tokens=list(tokens), rollout_logprobs=list(logprobs),
               loss_mask=list(mask), reward=float(sid.endswith("1")), status=status, finish_reason="stop",
               weight_version="0", temperature=1.0)


def dataset(root: Path, bad_rows: list[Row] | None = None, *, table: pa.Table | None = None,
            schema_version: str = SCHEMA_VERSION, damage=None) -> Path:
    """Writer a's clean shard, and shard b of ``bad_rows`` (or ``table``) written with pyarrow, one row per
    row group, uncompressed; ``damage(path)`` may then change the file. b's manifest records the result."""
    with ShardWriter(root, writer_id="a") as w:
        w.write_groups(synthetic_table(CLEAN_GROUPS, 2, seed=1, prefix="a", prompt_len=(2, 5), response_len=(2, 8)))
    if table is None:
        table = rows_to_table(bad_rows or [row("b-0"), row("b-1")])
    table = table.replace_schema_metadata({META_SCHEMA_VERSION: schema_version.encode(), META_CONFIG: b"{}"})
    pq.write_table(table, root / BAD, row_group_size=1, compression="none")
    if damage is not None:
        damage(root / BAD)
    storage = Storage(root)
    info = ShardInfo(path=BAD, rows=table.num_rows, groups=1, prompt_tokens=0, response_tokens=0,
                     bytes=storage.size(BAD), sha256=storage.sha256(BAD), writer_id="b",
                     created_at="2026-01-01T00:00:00.000+00:00")
    Manifest(writer_id="b", shards=[info]).save(storage)
    return root


def steps_until_error(root: Path, **cfg) -> tuple[list[Step], DataError]:
    """Steps handed on before the loader (opening included) raised a DataError, and the error."""
    steps: list[Step] = []
    config = LoaderConfig(groups_per_step=1, shuffle=False, shuffle_window=1, prefetch=2, **cfg)
    with pytest.raises(DataError) as info:
        with RolloutLoader(root, config) as loader:
            for step in loader:
                steps.append(step)
    return steps, info.value


def sample_ids(steps: list[Step]) -> set[str]:
    return {sid for s in steps for b in s.micro_batches for sid in b.sample_ids}


def assert_refused(root: Path, message: str, *, clean_steps: int | None = CLEAN_GROUPS, **cfg) -> DataError:
    steps, error = steps_until_error(root, **cfg)
    assert str(error) == message
    assert "\n" not in str(error)
    assert not {s for s in sample_ids(steps) if s.startswith("b-")}, "a step held a row of the bad shard"
    if clean_steps is not None:  # the clean shard before it is still trained on
        assert len(steps) == clean_steps and all(s.startswith("a") for s in sample_ids(steps))
    return error


# -- row invariants, each block as it is read --------------------------------------------------------


def test_nan_logprob_under_the_mask(tmp_path):
    root = dataset(tmp_path, [row("b-0"), row("b-1", logprobs=(-0.1, float("nan"), -0.3))])
    assert_refused(root, f"{BAD} {RGS}: sample 'b-1': rollout_logprobs: token 1 has logprob nan under "
                         f"loss_mask 1; engine logprobs must be finite and <= 0; {VALIDATE}")


def test_positive_logprob(tmp_path):
    root = dataset(tmp_path, [row("b-0", logprobs=(-0.1, -0.2, 0.5)), row("b-1")])
    assert_refused(root, f"{BAD} {RGS}: sample 'b-0': rollout_logprobs: token 2 has logprob 0.5 under "
                         f"loss_mask 1; engine logprobs must be finite and <= 0; {VALIDATE}")


def test_unknown_status_is_refused_not_filtered(tmp_path):
    table = rows_to_table([row("b-0"), row("b-1")])
    table = table.set_column(table.schema.get_field_index("status"), "status", pa.array(["completed", "done"]))
    root = dataset(tmp_path, table=table)
    assert_refused(root, f"{BAD} {RGS}: sample 'b-1': status: 'done' is not one of completed, truncated, "
                         f"aborted, failed; {VALIDATE}")


def test_misaligned_logprobs(tmp_path):
    root = dataset(tmp_path, [row("b-0", logprobs=(-0.1, -0.2)), row("b-1")])
    assert_refused(root, f"{BAD} {RGS}: sample 'b-0': rollout_logprobs: length 2 and loss_mask length 3 "
                         "must both equal response_tokens length 3; keep the engine's logprob of every response "
                         f"token; {VALIDATE}")


def test_negative_token_id(tmp_path):
    root = dataset(tmp_path, [row("b-0"), row("b-1", tokens=(1, -5, 3))])
    assert_refused(root, f"{BAD} {RGS}: sample 'b-1': response_tokens: token ids must be non-negative; "
                         f"{VALIDATE}")


def test_a_bad_row_the_filters_drop_still_stops_the_loader(tmp_path):
    # b-1 is aborted (filtered out by the default statuses) but its logprob is NaN: the shard is damaged.
    root = dataset(tmp_path, [row("b-0"), row("b-1", logprobs=(float("nan"),) * 3, status=Status.ABORTED)])
    error = assert_refused(root, f"{BAD} {RGS}: sample 'b-1': rollout_logprobs: token 0 has logprob nan "
                                 f"under loss_mask 1; engine logprobs must be finite and <= 0; {VALIDATE}")
    assert isinstance(error, ValueError)  # callers that catch ValueError for bad input keep working


# -- the shard's file: types, columns, footer, version, checksum -----------------------------------------


@pytest.mark.parametrize("column,cast_to,found,expected", [
    ("response_tokens", pa.list_(pa.int64()), "list<int64>", "list<int32>"),
    ("rollout_logprobs", pa.list_(pa.float64()), "list<double>", "list<float>"),
])
def test_wrong_column_types_are_refused_not_cast(tmp_path, column, cast_to, found, expected):
    table = rows_to_table([row("b-0"), row("b-1")])
    i = table.schema.get_field_index(column)
    table = table.set_column(i, column, table.column(column).cast(cast_to))
    root = dataset(tmp_path, table=table)
    assert_refused(root, f"{BAD}: column {column!r} is {found}, expected {expected} (rollshard schema v{SCHEMA_VERSION}); readers "
                         "do not cast: rewrite the shard with rollshard's ShardWriter, which casts to the schema",
                   clean_steps=0)


def test_missing_column(tmp_path):
    root = dataset(tmp_path, table=rows_to_table([row("b-0"), row("b-1")]).drop(["rollout_logprobs"]))
    assert_refused(root, f"{BAD}: lacks column 'rollout_logprobs' (list<float>) of rollshard schema v{SCHEMA_VERSION}; "
                         f"{VALIDATE}", clean_steps=0)


def test_truncated_footer(tmp_path):
    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:-20])  # the manifest then records the cut file

    root = dataset(tmp_path, damage=truncate)
    steps, error = steps_until_error(root)
    assert steps == [] and str(error).startswith(f"{BAD}: not readable as Parquet (")
    assert str(error).endswith(f"); {VALIDATE}") and "\n" not in str(error)


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
def test_a_shard_changed_after_its_manifest_entry(tmp_path, change):
    root = dataset(tmp_path)
    size = (root / BAD).stat().st_size
    if change == "truncate":  # the footer no longer reads
        (root / BAD).write_bytes((root / BAD).read_bytes()[: size // 2])
    else:  # a valid Parquet file, other row groups
        pq.write_table(pq.read_table(root / BAD), root / BAD, row_group_size=2)
    new_size = (root / BAD).stat().st_size
    assert new_size != size
    _, error = steps_until_error(root)
    assert str(error) == (f"{BAD}: {new_size} bytes on disk, the manifest says {size}: the shard changed "
                          f"after it was committed; {VALIDATE}")


def test_a_newer_schema_shard_after_a_1x_shard(tmp_path, capsys):
    root = dataset(tmp_path, schema_version="2.0")
    message = (f"{BAD}: written with rollshard schema 2.0, this rollshard reads schema 1.x; upgrade rollshard to "
               "read it")
    with pytest.raises(SchemaVersionError) as info:
        RolloutDataset.open(root)
    assert str(info.value) == message
    assert str(steps_until_error(root)[1]) == message
    for command in ("stats", "inspect"):  # refused, not counted
        assert main([command, str(root)]) == 2
        err = capsys.readouterr().err
        assert err == f"rollshard-store: error: {message}\n"


def flip(path: Path, column: str, at: float = 0.5) -> None:
    """Flip one byte inside row group 0's chunk of ``column`` (uncompressed: the byte is a value's)."""
    meta = pq.ParquetFile(path).metadata
    names = [meta.schema.column(i).path.split(".")[0] for i in range(meta.num_columns)]
    chunk = meta.row_group(0).column(names.index(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + int(chunk.total_compressed_size * at)] ^= 0x40
    path.write_bytes(bytes(data))


def checksum_message(root: Path) -> str:
    entry = json.loads((root / "_manifests/b.json").read_text())["shards"][0]
    actual = Storage(root).sha256(BAD)
    return (f"{BAD}: sha256 {actual[:16]}... differs from the manifest's {entry['sha256'][:16]}...: the shard was "
            f"damaged or changed after it was committed; {VALIDATE}")


def test_flipped_byte_in_a_column_the_loader_does_not_read(tmp_path):
    # Only the checksum can see this one; the steps of b are planned but must never be handed on.
    root = dataset(tmp_path)
    flip(root / BAD, "response_text", at=0.9)
    assert pq.read_table(root / BAD, columns=["sample_id", "rollout_logprobs"]).num_rows == 2  # what is read reads
    assert_refused(root, checksum_message(root))


def test_flipped_byte_in_the_logprobs_names_the_checksum(tmp_path):
    # The flipped value breaks an invariant as the block is read; the message names the cause, the checksum.
    root = dataset(tmp_path)
    flip(root / BAD, "rollout_logprobs", at=0.97)
    assert_refused(root, checksum_message(root))


def test_each_shard_is_hashed_once_per_loader_and_the_thread_stops(tmp_path, monkeypatch):
    # Adapted for per-block checks: a (manifest v3, byte ranges) has its footer checked once per loader and
    # its block's bytes at every read; only b (an entry without ranges) is hashed whole, once.
    import rollshard.store.loader.stream as stream_mod

    root = dataset(tmp_path)
    hashed: list[str] = []
    footers: list[str] = []
    blocks: list[str] = []
    real, real_footer, real_ranges = integrity.verify_sha256, integrity.verify_footer, stream_mod.verify_ranges

    def counting(storage, info, stop=None):
        hashed.append(info.path)
        return real(storage, info, stop)

    def counting_footer(storage, info, stop=None, parsed=None):
        footers.append(info.path)
        return real_footer(storage, info, stop, parsed)

    def counting_ranges(info, row_groups, offset, data):
        blocks.append(info.path)
        return real_ranges(info, row_groups, offset, data)

    monkeypatch.setattr(integrity, "verify_sha256", counting)
    monkeypatch.setattr(integrity, "verify_footer", counting_footer)
    monkeypatch.setattr(stream_mod, "verify_ranges", counting_ranges)
    config = LoaderConfig(groups_per_step=1, num_epochs=3, shuffle_window=2)
    with RolloutLoader(root, config) as loader:
        assert len(list(loader)) == 3 * (CLEAN_GROUPS + 1)
    assert hashed == [BAD] and footers == ["shards/a-00000.parquet"]
    assert blocks == ["shards/a-00000.parquet"] * 3  # a's one block, read once an epoch
    assert not [t for t in threading.enumerate() if t.name.startswith("rollshard-checksum")]


def test_hf_groups_check_the_shards_too(tmp_path):
    root = dataset(tmp_path, [row("b-0"), row("b-1", logprobs=(-0.1, 0.25, -0.3))])
    with pytest.raises(DataError, match=r"^shards/b-00000.parquet \(row groups 0, 1\): sample 'b-1': rollout_logprobs"):
        list(hf_groups(root, LoaderConfig()))
    flipped = dataset(tmp_path / "flipped")
    flip(flipped / BAD, "response_text", at=0.9)
    with pytest.raises(DataError, match="sha256 .* differs from the manifest's"):
        list(hf_groups(flipped, LoaderConfig()))


def test_checks_off_lets_the_bad_rows_through(tmp_path):
    # What the checks are measured against (tests/bench/bench_loader.py): verify_data=False delivers b.
    root = dataset(tmp_path, [row("b-0"), row("b-1", logprobs=(-0.1, 0.5, -0.3))])
    with RolloutLoader(root, LoaderConfig(groups_per_step=1, tail="partial", verify_data=False)) as loader:
        assert {"b-0", "b-1"} <= sample_ids(list(loader))


def test_close_stops_a_checksum_in_progress_and_a_new_iteration_hashes_again(tmp_path, monkeypatch):
    root = dataset(tmp_path)
    started = threading.Event()
    real = integrity.verify_sha256

    def blocking(storage, info, stop=None):  # a hash that only ends when it is told to stop
        started.set()
        stop.wait()
        return False

    monkeypatch.setattr(integrity, "verify_sha256", blocking)
    loader = RolloutLoader(root, LoaderConfig(groups_per_step=1, tail="partial"))
    it = iter(loader)
    assert started.wait(60)
    loader.close()
    del it
    assert not [t for t in threading.enumerate() if t.name.startswith("rollshard-checksum")]
    monkeypatch.setattr(integrity, "verify_sha256", real)
    assert len(list(loader)) == CLEAN_GROUPS + 1  # the interrupted shard is hashed from the start


def test_a_list_whose_items_are_declared_not_null_is_the_schema_type(tmp_path):
    # Some writers declare list items non-nullable (list<element: int32 not null>): the same value type.
    table = rows_to_table([row("b-0"), row("b-1")])
    i = table.schema.get_field_index("prompt_tokens")
    strict = pa.list_(pa.field("element", pa.int32(), nullable=False))
    table = table.set_column(i, pa.field("prompt_tokens", strict, nullable=False), table.column(i).cast(strict))
    root = dataset(tmp_path, table=table)
    with RolloutLoader(root, LoaderConfig(groups_per_step=1, shuffle=False, tail="partial")) as loader:
        assert len(sample_ids(list(loader))) == 2 * CLEAN_GROUPS + 2


def test_a_weight_version_the_staleness_filter_cannot_read_names_the_shard(tmp_path):
    bad = [row("b-0"), row("b-1")]
    bad[1].weight_version = "v7"
    root = dataset(tmp_path, bad)
    assert_refused(root, f"{BAD} {RGS}: weight_version 'v7' is not an integer; the staleness filter (max_staleness) "
                         "compares integer policy versions: record the training step as the engine's weight_version, "
                         "or turn max_staleness off", max_staleness=3, current_version="0")

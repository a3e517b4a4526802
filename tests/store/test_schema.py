import datetime as dt
import math

import pyarrow as pa
import pytest

from rollshard.store.schema import (
    ROW_SCHEMA,
    Row,
    SchemaVersionError,
    Status,
    WeightSpan,
    check_schema_version,
    check_table,
    file_metadata,
    rows_to_table,
)


def make_row(**over) -> Row:
    kw = dict(
        sample_id="p0/solver/0/0",
        prompt_id="p0",
        group_id="p0/solver/0",
        agent="solver",
        round=0,
        prompt_tokens=[5, 6, 7],
        response_tokens=[8, 9, 10, 11],
        rollout_logprobs=[-0.5, 0.0, 0.0, -1.25],
        loss_mask=[1, 0, 0, 1],  # a tool result (ids 9, 10) between two model turns
        reward=1.0,
        status=Status.COMPLETED,
        finish_reason="stop",
        weight_version="3",
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        prompt_text="q",
        response_text="a",
        metadata={"task": "math", "label": "4"},
        created_at=dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=dt.timezone.utc),
    )
    kw.update(over)
    return Row(**kw)


def test_round_trip_every_column_type():
    rows = [
        make_row(),
        make_row(
            sample_id="p0/solver/0/1",
            response_tokens=[],
            rollout_logprobs=[],
            loss_mask=[],
            reward=None,
            status=Status.FAILED,
            finish_reason=None,
            weight_version=None,
            weight_versions=None,
            temperature=None,
            top_p=None,
            top_k=None,
            prompt_text=None,
            response_text=None,
            metadata=None,
        ),
        make_row(
            sample_id="p0/solver/0/2",
            weight_versions=[WeightSpan(version="2", start=0, end=2), WeightSpan(version="3", start=2, end=4)],
        ),
    ]
    table = rows_to_table(rows)
    assert table.schema.equals(ROW_SCHEMA)
    assert check_table(table) == []
    back = [Row.from_dict(d) for d in table.to_pylist()]
    assert back[0].response_tokens == [8, 9, 10, 11]
    assert back[0].loss_mask == [1, 0, 0, 1]
    assert back[0].rollout_logprobs == [-0.5, 0.0, 0.0, -1.25]  # exact in float32
    assert back[0].status is Status.COMPLETED
    assert back[0].metadata == '{"label": "4", "task": "math"}'
    assert back[0].created_at == rows[0].created_at
    assert back[0].temperature == pytest.approx(0.7, abs=1e-7)  # float32
    # One weight version and no spans: a single span covering the whole response.
    assert back[0].weight_versions == [WeightSpan(version="3", start=0, end=4)]
    assert back[1].response_tokens == [] and back[1].reward is None and back[1].weight_versions is None
    assert back[2].weight_versions[1] == WeightSpan(version="3", start=2, end=4)


@pytest.mark.parametrize(
    "over, field, fragment",
    [
        # The bug of slime PR #1995: response tokens kept, logprobs dropped.
        (dict(rollout_logprobs=[]), "rollout_logprobs", "length 0 and loss_mask length 4 must both equal response_tokens length 4"),
        (dict(loss_mask=[1, 1]), "rollout_logprobs", "loss_mask length 2"),
        (dict(rollout_logprobs=[-0.5, 0.0, 0.0, 0.25]), "rollout_logprobs", "token 3 has logprob 0.25 under loss_mask 1"),
        (dict(rollout_logprobs=[-0.5, 0.0, 0.0, math.nan]), "rollout_logprobs", "token 3 has logprob nan"),
        (dict(rollout_logprobs=[-math.inf, 0.0, 0.0, -1.0]), "rollout_logprobs", "token 0 has logprob -inf"),
        (dict(rollout_logprobs=[-0.5, -0.1, 0.0, -1.0]), "rollout_logprobs", "token 1 has logprob -0.1 under loss_mask 0"),
        (dict(loss_mask=[1, 0, 2, 1]), "loss_mask", "values must be 0 or 1"),
        (dict(response_tokens=[8, -9, 10, 11]), "response_tokens", "non-negative"),
        (dict(prompt_tokens=[-1]), "prompt_tokens", "non-negative"),
        (dict(reward=None), "reward", "only a failed row may lack a finite reward"),
        (dict(reward=math.inf), "reward", "only a failed row"),
        (dict(group_id=""), "group_id", "is empty"),
        (dict(sample_id=""), "sample_id", "is empty"),
        # Trained as if sampled at 1.0 otherwise: the trainer divides logits by each row's temperature.
        (dict(temperature=None), "temperature", "is None on a row with trained tokens (loss_mask 1)"),
        (dict(temperature=math.nan), "temperature", "is nan on a row with trained tokens"),
        (dict(temperature=math.inf), "temperature", "is inf on a row with trained tokens"),
        (dict(temperature=-1.0), "temperature", "is -1.0 on a row with trained tokens"),
    ],
)
def test_each_invariant_break_is_reported_with_sample_and_field(over, field, fragment):
    problems = check_table(rows_to_table([make_row(**over)]))
    assert len(problems) == 1, problems
    p = problems[0]
    assert p.field == field
    assert fragment in p.detail, p.detail
    assert p.message().startswith(f"sample {p.sample_id!r}: {field}: ")


def test_a_null_temperature_is_allowed_without_trained_tokens():
    # Environment-only (loss_mask all 0) and empty responses are never trained: no temperature is needed.
    env_only = make_row(sample_id="env", temperature=None, loss_mask=[0, 0, 0, 0], rollout_logprobs=[0.0] * 4)
    empty = make_row(sample_id="empty", temperature=None, response_tokens=[], loss_mask=[], rollout_logprobs=[])
    assert check_table(rows_to_table([make_row(), env_only, empty])) == []


def test_unknown_status_and_duplicate_ids():
    t = rows_to_table([make_row(), make_row()])
    t = t.set_column(t.schema.get_field_index("status"), "status", pa.array(["completed", "exploded"]))
    problems = check_table(t)
    assert [(p.field, p.detail) for p in problems] == [
        ("status", "'exploded' is not one of completed, truncated, aborted, failed"),
        ("sample_id", "appears more than once"),
    ]


def test_nulls_in_required_columns_are_reported():
    # pyarrow's from_pylist does not enforce nullable=False; Parquet would refuse the row
    # only at flush, naming no sample.
    bad = make_row(sample_id="b").to_dict() | dict(round=None, response_tokens=None, rollout_logprobs=None, loss_mask=None)
    t = rows_to_table([make_row(), bad])
    problems = check_table(t)
    assert [(p.sample_id, p.field, p.detail) for p in problems] == [
        ("b", "round", "is null"),
        ("b", "response_tokens", "is null"),
        ("b", "rollout_logprobs", "is null"),
        ("b", "loss_mask", "is null"),
    ]


def test_token_id_out_of_int32_is_refused():
    with pytest.raises(ValueError, match="schema v1.0"):
        rows_to_table([make_row(response_tokens=[2**31, 1, 2, 3])])


def test_status_from_finish_reason():
    assert Status.from_finish_reason("stop") is Status.COMPLETED
    assert Status.from_finish_reason("length") is Status.TRUNCATED
    assert Status.from_finish_reason("abort") is Status.ABORTED
    assert Status.from_finish_reason("weird") is Status.FAILED


def test_schema_version_checks():
    assert check_schema_version(file_metadata({}), "f") == "1.0"
    assert check_schema_version({b"rollshard.schema_version": b"1.7"}, "f") == "1.7"
    with pytest.raises(SchemaVersionError, match="written with rollshard schema 2.0, this rollshard reads schema 1.x; upgrade"):
        check_schema_version({b"rollshard.schema_version": b"2.0"}, "f")
    with pytest.raises(SchemaVersionError, match="not a rollshard shard"):
        check_schema_version({}, "f")

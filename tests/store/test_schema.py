import datetime as dt
import math

import pyarrow as pa
import pytest

from rollshard.store.format.invariants import check_projection, check_table
from rollshard.store.format.schema import (
    OPTIONAL_COLUMNS,
    ROW_SCHEMA,
    SCHEMA_VERSION,
    Row,
    SchemaVersionError,
    Status,
    WeightSpan,
    cast_table,
    check_schema_version,
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
    with pytest.raises(ValueError, match=f"schema v{SCHEMA_VERSION}"):
        rows_to_table([make_row(response_tokens=[2**31, 1, 2, 3])])


def test_status_from_finish_reason():
    assert Status.from_finish_reason("stop") is Status.COMPLETED
    assert Status.from_finish_reason("length") is Status.TRUNCATED
    assert Status.from_finish_reason("abort") is Status.ABORTED
    assert Status.from_finish_reason("weird") is Status.FAILED


def test_schema_version_checks():
    assert check_schema_version(file_metadata({}), "f") == "1.2"
    assert check_schema_version({b"rollshard.schema_version": b"1.7"}, "f") == "1.7"
    with pytest.raises(SchemaVersionError, match="written with rollshard schema 2.0, this rollshard reads schema 1.x; upgrade"):
        check_schema_version({b"rollshard.schema_version": b"2.0"}, "f")
    with pytest.raises(SchemaVersionError, match="not a rollshard shard"):
        check_schema_version({}, "f")


# -- schema 1.1: the sampling support -------------------------------------------------------

# make_row's response [8, 9, 10, 11], mask [1, 0, 0, 1], rollout logprobs [-0.5, 0, 0, -1.25]: tokens 0 and 3
# were sampled from a top-k support (each holding the sampled id), tokens 1 and 2 are a tool result.
SUPPORT = [[3, 8, 40], [], [], [2, 11]]
SAMPLING_LOGPROBS = [-0.25, 0.0, 0.0, -1.0]  # >= the rollout logprobs: truncation raises the probability


def sampled_row(**over) -> Row:
    return make_row(**{"sampling_logprobs": SAMPLING_LOGPROBS, "sampling_support": SUPPORT, **over})


def test_a_row_with_a_support_passes_and_round_trips():
    rows = [sampled_row(), make_row(sample_id="p0/solver/0/1")]  # with and without a support, in one table
    table = rows_to_table(rows)
    assert check_table(table) == []
    back = [Row.from_dict(d) for d in table.to_pylist()]
    assert back[0].sampling_support == SUPPORT
    assert back[0].sampling_logprobs == SAMPLING_LOGPROBS  # exact in float32
    assert back[1].sampling_support is None and back[1].sampling_logprobs is None


@pytest.mark.parametrize(
    "over, field, fragment",
    [
        (dict(sampling_support=[[3, 40], [], [], [2, 11]]), "sampling_support",
         "token 0 (id 8) is not in its support [3, 40]; the sampled token must be in the set"),
        (dict(sampling_support=[[8], [], [], []]), "sampling_support", "token 3 has an empty support under loss_mask 1"),
        (dict(sampling_support=[[8, 3, 8], [], [], [2, 11]]), "sampling_support", "token 0 has an id twice"),
        (dict(sampling_support=[[8, 8], [], [], [2, 11]]), "sampling_support", "token 0 has an id twice"),
        (dict(sampling_support=[[8, -3], [], [], [2, 11]]), "sampling_support", "token 0 has a negative id"),
        (dict(sampling_support=[[8], [9], [], [11]]), "sampling_support",
         "token 1 has a support of 1 ids under loss_mask 0"),
        (dict(sampling_support=[[8], [], []]), "sampling_support", "length 3 must equal response_tokens length 4"),
        (dict(sampling_logprobs=[-0.25, 0.0, 0.0]), "sampling_logprobs", "length 3 must equal response_tokens length 4"),
        (dict(sampling_logprobs=[0.01, 0.0, 0.0, -1.0]), "sampling_logprobs", "token 0 has sampling logprob 0.01"),
        (dict(sampling_logprobs=[-0.25, 0.0, 0.0, -1.5]), "sampling_logprobs",
         "token 3 has sampling logprob -1.5 under loss_mask 1 (rollout logprob -1.25)"),
        (dict(sampling_logprobs=[math.nan, 0.0, 0.0, -1.0]), "sampling_logprobs", "token 0 has sampling logprob nan"),
        (dict(sampling_logprobs=[-math.inf, 0.0, 0.0, -1.0]), "sampling_logprobs", "token 0 has sampling logprob -inf"),
        (dict(sampling_logprobs=[-0.25, -0.5, 0.0, -1.0]), "sampling_logprobs",
         "token 1 has sampling logprob -0.5 under loss_mask 0"),
        (dict(sampling_logprobs=None), "sampling_logprobs", "is null while sampling_support is present"),
        (dict(sampling_support=None), "sampling_support", "is null while sampling_logprobs is present"),
    ],
)
def test_each_sampling_invariant_break_is_reported_with_sample_and_field(over, field, fragment):
    problems = check_table(rows_to_table([make_row(sample_id="ok"), sampled_row(sample_id="bad", **over)]))
    assert [(p.sample_id, p.field) for p in problems] == [("bad", field)], problems
    assert fragment in problems[0].detail, problems[0].detail


def test_sampling_tolerances_are_the_documented_ones():
    # 1e-6 above 0 and 1e-4 below the rollout logprob pass (engine fp32 rounding); twice that does not.
    within = sampled_row(sample_id="a", sampling_logprobs=[1e-6, 0.0, 0.0, -1.25 - 0.9e-4])
    beyond_top = sampled_row(sample_id="b", sampling_logprobs=[2e-6, 0.0, 0.0, -1.0])
    beyond_floor = sampled_row(sample_id="c", sampling_logprobs=[-0.25, 0.0, 0.0, -1.25 - 2e-4])
    problems = check_table(rows_to_table([within, beyond_top, beyond_floor]))
    assert [(p.sample_id, p.field) for p in problems] == [("b", "sampling_logprobs"), ("c", "sampling_logprobs")]


def test_sampling_checks_only_rows_with_a_support_and_name_the_right_row():
    # A bad row after a row without a support and a good one: the flat positions must map back to row 2.
    rows = [make_row(sample_id="none"), sampled_row(sample_id="good"),
            sampled_row(sample_id="bad", sampling_support=[[8], [], [], [2, 12]])]
    problems = check_table(rows_to_table(rows))
    assert [(p.sample_id, p.field) for p in problems] == [("bad", "sampling_support")]
    assert "token 3 (id 11) is not in its support [2, 12]" in problems[0].detail


def test_check_projection_covers_the_sampling_columns():
    names = ["sample_id", "response_tokens", "rollout_logprobs", "loss_mask", *OPTIONAL_COLUMNS]
    table = rows_to_table([sampled_row(sampling_support=[[3], [], [], [2, 11]])]).select(names)
    assert [p.field for p in check_projection(table)] == ["sampling_support"]


def test_cast_table_fills_the_optional_columns_of_an_older_table():
    old = rows_to_table([make_row()]).drop_columns(list(OPTIONAL_COLUMNS))  # a 1.0 table
    table = cast_table(old)
    assert table.schema.equals(ROW_SCHEMA)
    assert table.column("sampling_support").null_count == 1 and table.column("sampling_logprobs").null_count == 1
    with pytest.raises(ValueError, match=r"lacks columns \['reward'\]"):
        cast_table(old.drop_columns(["reward"]))

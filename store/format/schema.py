"""Schema v1 of a rollout row: the explicit Arrow schema, the matching dataclass, the file metadata.

One row is one trainable trajectory of one agent: the prompt it saw, the response it
produced, the engine's logprob of every response token, and the loss mask. The
schema is declared once here; every batch written is cast to it, and every batch
written or validated goes through :func:`~rollshard.store.format.invariants.check_table`
(store/format/invariants.py: the row invariants, vectorized with pyarrow/numpy so that
checking costs little next to compressing).

Schema 1.1 adds the **sampling support** of each response token, for importance ratios
that know the engine sampled from a top-p/top-k truncated, renormalized distribution
(SGLang's ``meta_info.output_token_sampling_logprobs`` and ``output_token_sampling_mask``):

* ``sampling_logprobs[i]``: the logprob of ``response_tokens[i]`` under the truncated,
  renormalized distribution; ``sampling_support[i]``: the token ids of that distribution
  (kept in the order the engine gave them). Both null (an engine that did not truncate or
  was not asked; every 1.0 shard, which lacks the columns: readers see nulls), or both
  present with one entry per response token. A row with only one of them is refused.
  Their invariants are checked in store/format/invariants.py.

On disk the support is a nested ``list<list<int32>>`` (measured against flat ids plus
per-token sizes in tests/bench/bench_store.py ``--supports``: the same bytes within 0.1%,
and Arrow hands the loader the flat ids and offsets of a nested list without a copy).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
from typing import Any, Iterable, Sequence

import pyarrow as pa

from rollshard.store.common import DataError
from rollshard.store.format.routing import ROUTING_COLUMN

SCHEMA_VERSION = "1.2"
# Temperatures below this are greedy (SGLang's _SAMPLING_EPS): the logprob is then
# log softmax(logits), not of logits / temperature. Engines and trainer share it.
GREEDY_TEMPERATURE_EPS = 1e-6
SCHEMA_MAJOR = 1
# Schema 1.1 sampling logprobs: how far above 0 (fp32 rounding of a log-softmax over a support of one dominant
# token) and below the full-softmax rollout logprob (engine rounding of two log-softmaxes) a stored one may be.
SAMPLING_LOGPROB_MAX = 1e-6
SAMPLING_LOGPROB_TOL = 1e-4
META_SCHEMA_VERSION = b"rollshard.schema_version"
META_CONFIG = b"rollshard.config"


class Status(str, enum.Enum):
    """Outcome of one agent call; mirrors slime's sample status."""

    COMPLETED = "completed"  # engine stopped on eos / a stop string
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # engine aborted the request
    FAILED = "failed"  # no usable response; reward may be null

    @classmethod
    def from_finish_reason(cls, finish_reason: str) -> "Status":
        """SGLang finish reason type -> status (slime's rule: length -> truncated, abort -> aborted)."""
        return {"stop": cls.COMPLETED, "length": cls.TRUNCATED, "abort": cls.ABORTED}.get(
            finish_reason, cls.FAILED
        )


STATUS_VALUES = tuple(s.value for s in Status)

WEIGHT_SPAN = pa.struct(
    [pa.field("version", pa.string()), pa.field("start", pa.int32()), pa.field("end", pa.int32())]
)

ROW_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("agent", pa.string(), nullable=False),
        pa.field("round", pa.int16(), nullable=False),
        pa.field("prompt_tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("response_tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("reward", pa.float32()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string()),
        pa.field("weight_version", pa.string()),
        pa.field("weight_versions", pa.list_(WEIGHT_SPAN)),
        pa.field("temperature", pa.float32()),
        pa.field("top_p", pa.float32()),
        pa.field("top_k", pa.int32()),
        pa.field("prompt_text", pa.string()),
        pa.field("response_text", pa.string()),
        pa.field("metadata", pa.string()),
        pa.field("created_at", pa.timestamp("ms", tz="UTC")),
        # Schema 1.1: the sampling support of each response token (null when the engine did not truncate, or was
        # not asked; both columns are absent from 1.0 shards). Under loss_mask 0: 0.0 and an empty support.
        pa.field("sampling_logprobs", pa.list_(pa.float32())),  # logprob under the truncated, renormalized distribution
        pa.field("sampling_support", pa.list_(pa.list_(pa.int32()))),  # the token ids the engine sampled from
        # Schema 1.2: each MoE layer's top-k expert ids at every forwarded position (store/format/routing.py); null for a
        # dense model or an engine not asked; absent from older shards.
        pa.field("routed_experts", pa.binary()),
    ]
)
# The schema 1.1 sampling pair: both present or both absent (a 1.0 shard, read as nulls).
OPTIONAL_COLUMNS = ("sampling_logprobs", "sampling_support")
# Every column a shard of an older 1.x schema may lack (read as nulls): the sampling pair and the 1.2 routing.
ADDED_COLUMNS = (*OPTIONAL_COLUMNS, ROUTING_COLUMN)
# Per-token columns (never dictionary-encoded).
LIST_COLUMNS = (
    "prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask", "weight_versions", *ADDED_COLUMNS,
)


@dataclasses.dataclass(kw_only=True, slots=True)
class WeightSpan:
    """Response token positions ``[start, end)`` produced by one policy version."""

    version: str
    start: int
    end: int


@dataclasses.dataclass(kw_only=True, slots=True)
class Row:
    """One trainable trajectory of one agent; field for field the columns of :data:`ROW_SCHEMA`."""

    sample_id: str
    prompt_id: str
    group_id: str
    agent: str
    round: int
    prompt_tokens: Sequence[int]
    response_tokens: Sequence[int]
    rollout_logprobs: Sequence[float]
    loss_mask: Sequence[int]
    reward: float | None
    status: Status
    finish_reason: str | None = None
    weight_version: str | None = None
    weight_versions: list[WeightSpan] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    prompt_text: str | None = None
    response_text: str | None = None
    metadata: dict[str, Any] | str | None = None
    created_at: dt.datetime | None = None
    sampling_logprobs: Sequence[float] | None = None  # schema 1.1, see ROW_SCHEMA
    sampling_support: Sequence[Sequence[int]] | None = None
    routed_experts: bytes | None = None  # schema 1.2, see store/format/routing.py (RoutingShape.encode makes it)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the schema's column types (shallow: token lists are not copied)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["status"] = Status(self.status).value
        if self.weight_versions is not None:
            d["weight_versions"] = [
                {"version": s.version, "start": s.start, "end": s.end} if isinstance(s, WeightSpan) else s
                for s in self.weight_versions
            ]
        elif self.weight_version is not None:
            d["weight_versions"] = [{"version": self.weight_version, "start": 0, "end": len(self.response_tokens)}]
        if self.metadata is not None and not isinstance(self.metadata, str):
            d["metadata"] = json.dumps(self.metadata, sort_keys=True)
        if self.created_at is None:
            d["created_at"] = dt.datetime.now(dt.timezone.utc)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Row":
        kw = dict(d)
        kw["status"] = Status(kw["status"])
        if kw.get("weight_versions") is not None:
            kw["weight_versions"] = [WeightSpan(**s) for s in kw["weight_versions"]]
        return cls(**kw)


class SchemaVersionError(DataError):
    """A file was written with a schema this rollshard cannot read."""


class RowInvariantError(ValueError):
    """A row breaks an invariant of the schema; the message names the sample and the field."""

    def __init__(self, problems: list["Problem"]):
        self.problems = problems
        head = problems[0].message()
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        super().__init__(head + more)


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """One invariant break in one row."""

    sample_id: str | None
    field: str
    detail: str

    def message(self) -> str:
        return f"sample {self.sample_id!r}: {self.field}: {self.detail}"


def rows_to_table(rows: Iterable[Row | dict[str, Any]]) -> pa.Table:
    """Rows (dataclasses or dicts) -> a table cast to :data:`ROW_SCHEMA`."""
    dicts = [r.to_dict() if isinstance(r, Row) else r for r in rows]
    try:
        return pa.Table.from_pylist(dicts, schema=ROW_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
        raise ValueError(f"rows do not fit schema v{SCHEMA_VERSION}: {e}") from e


def cast_table(table: pa.Table) -> pa.Table:
    """Cast any table with the schema's columns to :data:`ROW_SCHEMA` (column order, types).

    :data:`ADDED_COLUMNS` a table lacks (one of an older 1.x schema) are filled with nulls.
    """
    if table.schema.equals(ROW_SCHEMA, check_metadata=False):  # already the schema: no select, no cast
        return table if table.schema.metadata is None else table.replace_schema_metadata(None)
    names = set(table.column_names)
    for name in ADDED_COLUMNS:
        if name not in names:
            table = table.append_column(ROW_SCHEMA.field(name), pa.nulls(table.num_rows, ROW_SCHEMA.field(name).type))
    names = set(table.column_names)
    missing = [n for n in ROW_SCHEMA.names if n not in names]
    if missing:
        raise ValueError(f"table lacks columns {missing}; a rollout table needs every column of schema v{SCHEMA_VERSION}")
    table = table.select(ROW_SCHEMA.names)
    if table.schema.equals(ROW_SCHEMA, check_metadata=False):
        return table.replace_schema_metadata(None)
    try:
        return table.cast(ROW_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ValueError(f"table does not cast to schema v{SCHEMA_VERSION}: {e}") from e


def data_bytes(table: pa.Table) -> int:
    """Arrow bytes of ``table`` without its all-null optional columns: the writer cuts a row group of rows
    without a sampling support where a schema 1.0 writer cut it."""
    unused = [n for n in ADDED_COLUMNS if n in table.column_names and table.column(n).null_count == table.num_rows]
    return table.nbytes - sum(table.column(n).nbytes for n in unused)


def file_metadata(config: dict[str, Any] | None) -> dict[bytes, bytes]:
    """Key/value metadata for a shard: schema version and the run's config as JSON."""
    return {
        META_SCHEMA_VERSION: SCHEMA_VERSION.encode(),
        META_CONFIG: json.dumps(config or {}, sort_keys=True, default=str).encode(),
    }


def check_schema_version(metadata: dict[bytes, bytes] | None, where: str) -> str:
    """Raise :class:`SchemaVersionError` for a file of a newer major schema; return its version."""
    version = (metadata or {}).get(META_SCHEMA_VERSION, b"").decode()
    if not version:
        raise SchemaVersionError(f"{where}: no {META_SCHEMA_VERSION.decode()} in the file metadata; not a rollshard shard")
    try:
        major = int(version.split(".")[0])
    except ValueError as e:
        raise SchemaVersionError(f"{where}: unreadable schema version {version!r}") from e
    if major > SCHEMA_MAJOR:
        raise SchemaVersionError(
            f"{where}: written with rollshard schema {version}, this rollshard reads schema {SCHEMA_MAJOR}.x; "
            "upgrade rollshard to read it"
        )
    return version


def config_of(metadata: dict[bytes, bytes] | None) -> dict[str, Any]:
    raw = (metadata or {}).get(META_CONFIG)
    return json.loads(raw) if raw else {}

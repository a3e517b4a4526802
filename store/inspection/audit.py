"""The per-token audit report: the trainer's logprob of every stored response token beside the engine's.

``rollshard-train audit`` writes it (one Parquet file, :data:`AUDIT_SCHEMA`, one row per trained token,
loss_mask 1); ``rollshard-store report --audit`` and ``rollshard-store inspect --sample worst-mismatch
--audit`` read it. The schema lives here, in store, because train writes it and store reads it; so do the
summary's numbers (:func:`summarize`, :func:`worst_tokens`), so that every view of one report shows the same.

Definitions, per token, with ``r = trainer_logprob - rollout_logprob`` (``log(pi / pi_rollout)``, in float64
from the stored float32 values):

* ``|r|``: its mean, max and the quantiles :data:`QUANTILES` (linear interpolation, numpy's default);
* ``ratio_outside``: the fraction of tokens whose ratio ``exp(r)`` is outside :data:`RATIO_BAND` (strictly);
* ``k3``: the mean of ``exp(r) - 1 - r``, the k3 estimate of KL(pi_rollout || pi) from the rollout's own
  samples, exactly the trainer's ``mismatch/k3_kl`` (rollshard.train.losses: ``r`` clamped at
  :data:`LOG_RATIO_CLAMP` inside the exp only).

Groups: by agent, by weight version (the row's last one; ``unknown`` when it has none), by response
position bucket (:data:`POSITION_EDGES`), by the row's stored temperature (0 is greedy: the logprob is then
of the unscaled logits) and by source (the ``--data`` source a row came from; one for a single dataset).

What was audited: the file's metadata names every ``--data`` source with its dataset's URI and fingerprint
(:data:`META_DATASETS`, :class:`AuditedDataset`; schema 1.1). Sample ids repeat across datasets (every round of
rollshard-loop reuses the prompt ids), so a reader pairs an audited token with its row by (dataset, sample_id):
the dataset whose fingerprint the report names for the token's ``source``. A 1.0 report names none
(:func:`audited_datasets` returns None).

Files are written atomically: to a temporary name beside the target, then renamed (on S3: uploaded, then
moved, so the final key appears whole or not at all); :func:`check_destination` checks the target up front,
before the work that makes the report. A reader refuses a report of a newer major version.
"""

from __future__ import annotations

import errno
import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rollshard.store.common import DataError, one_line, write_atomic

AUDIT_SCHEMA_VERSION = "1.1"  # 1.1: META_DATASETS names the datasets audited
AUDIT_SCHEMA_MAJOR = 1
META_AUDIT_VERSION = b"rollshard.audit_schema_version"
META_DATASETS = b"rollshard.audit_datasets"  # JSON list of AuditedDataset, one per source

AUDIT_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("agent", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),  # the --data source (mixture name; one for one dataset)
        pa.field("weight_version", pa.string()),  # the row's (last) version; null when the row has none
        pa.field("temperature", pa.float32(), nullable=False),  # the row's sampling temperature (1.0 when null)
        pa.field("position", pa.int32(), nullable=False),  # index in response_tokens
        pa.field("token", pa.int32(), nullable=False),
        pa.field("rollout_logprob", pa.float32(), nullable=False),  # the engine's, as stored
        pa.field("trainer_logprob", pa.float32(), nullable=False),  # recomputed: fp32 log softmax(logits / T)
    ],
    metadata={META_AUDIT_VERSION.decode(): AUDIT_SCHEMA_VERSION},
)

QUANTILES = (0.5, 0.9, 0.99)
RATIO_BAND = (0.9, 1.1)  # a ratio outside it is a token a PPO clip of 0.1 would already act on
# Same clamp as rollshard.train.losses.LOG_RATIO_CLAMP (store imports no train code; a test holds them equal):
# exp(20) stays finite in float32, so one token with a dropped logprob cannot make the k3 mean inf.
LOG_RATIO_CLAMP = 20.0
POSITION_EDGES = (16, 64, 256)  # buckets 0-15, 16-63, 64-255, 256+ of the response position
UNKNOWN_VERSION = "unknown"
CONTEXT_BEFORE, CONTEXT_AFTER = 8, 3  # tokens of decoded context around a worst token


class AuditSchemaError(DataError):
    """A file that is not an audit report, one of a newer major version, or one that cannot be read."""


@dataclass(frozen=True, kw_only=True)
class AuditedDataset:
    """One ``--data`` source of an audit: its name (the report's ``source`` column), the dataset's URI and its
    fingerprint (``RolloutDataset.fingerprint``) when audited."""

    source: str
    uri: str
    fingerprint: str

    @classmethod
    def of(cls, source: str, dataset) -> "AuditedDataset":
        """The entry of ``dataset`` (a RolloutDataset) read as ``source``; a local path made absolute."""
        return cls(source=source, uri=location(dataset.storage.uri), fingerprint=dataset.fingerprint)

    def __str__(self) -> str:
        return f"{self.uri} (fingerprint {self.fingerprint})"


def location(uri: str) -> str:
    """A dataset's URI as recorded and compared: a local path absolute, a URI as it is."""
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))


# -- the numbers ---------------------------------------------------------------------------------


def per_token(report: pa.Table | pl.DataFrame) -> pl.DataFrame:
    """The report with each token's ``diff`` (r), ``abs_diff``, ``k3``, ``outside`` (ratio outside the band),
    ``position_bucket`` and ``version_label`` (``weight_version``, :data:`UNKNOWN_VERSION` for null) columns."""
    df = report if isinstance(report, pl.DataFrame) else pl.from_arrow(report)
    r = df["trainer_logprob"].to_numpy().astype(np.float64) - df["rollout_logprob"].to_numpy().astype(np.float64)
    clamped = np.clip(r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N] as the trainer clamps before exp
    ratio = np.exp(clamped)  # [N]
    lo, hi = RATIO_BAND
    return df.with_columns(
        pl.Series("diff", r),
        pl.Series("abs_diff", np.abs(r)),
        pl.Series("k3", np.expm1(clamped) - r),  # the trainer's mismatch/k3_kl, token by token
        pl.Series("ratio", ratio),
        pl.Series("outside", (ratio < lo) | (ratio > hi)),
        position_bucket=_bucket_expr(),
        version_label=pl.col("weight_version").fill_null(UNKNOWN_VERSION),
    )


def temperature_label(t: float) -> str:
    """A stored float32 temperature as its shortest decimal (0.7, not 0.699999988)."""
    return str(np.float32(t))


def position_labels() -> list[str]:
    """``['0-15', '16-63', '64-255', '256+']`` for :data:`POSITION_EDGES`."""
    starts = (0, *POSITION_EDGES)
    return [f"{a}-{b - 1}" for a, b in zip(starts, POSITION_EDGES)] + [f"{POSITION_EDGES[-1]}+"]


def _bucket_expr() -> pl.Expr:
    labels = position_labels()
    expr = pl.lit(labels[-1])
    for edge, label in reversed(list(zip(POSITION_EDGES, labels))):
        expr = pl.when(pl.col("position") < edge).then(pl.lit(label)).otherwise(expr)
    return expr


def _stats_exprs() -> list[pl.Expr]:
    a = pl.col("abs_diff")
    return [
        pl.len().alias("tokens"),
        pl.struct("source", "sample_id").n_unique().alias("sequences"),  # ids repeat across sources
        a.mean().alias("mean"),
        a.max().alias("max"),
        *[a.quantile(q, interpolation="linear").alias(_qname(q)) for q in QUANTILES],
        pl.col("outside").mean().alias("ratio_outside"),
        pl.col("k3").mean().alias("k3"),
    ]


def _qname(q: float) -> str:
    return f"p{q * 100:g}"


STAT_KEYS = ("tokens", "sequences", "mean", "max", *map(_qname, QUANTILES), "ratio_outside", "k3")
GROUPS = {  # summary key -> column of per_token()
    "by_agent": "agent",
    "by_weight_version": "version_label",
    "by_position": "position_bucket",
    "by_temperature": "temperature",  # keyed by temperature_label()
    "by_source": "source",
}


def summarize(report: pa.Table | pl.DataFrame) -> dict[str, Any]:
    """The summary of a report as plain JSON: ``overall`` and one mapping per group in :data:`GROUPS`, each
    entry the stats of :data:`STAT_KEYS` (``tokens``, ``sequences``, ``mean``/``max``/``p50``/``p90``/``p99``
    of ``|r|``, ``ratio_outside``, ``k3``). An empty report has 0 tokens and None elsewhere."""
    df = per_token(report)
    overall = _row(df.select(_stats_exprs()).row(0, named=True)) if len(df) else _empty()
    out: dict[str, Any] = {
        "audit_schema_version": AUDIT_SCHEMA_VERSION,
        "ratio_band": list(RATIO_BAND),
        "overall": overall,
    }
    for key, column in GROUPS.items():
        grouped = df.group_by(column).agg(_stats_exprs()) if len(df) else df.select(column)
        label = temperature_label if column == "temperature" else str
        rows = {label(r[column]): _row(r) for r in grouped.iter_rows(named=True)}
        out[key] = {k: rows[k] for k in sorted(rows, key=_order(key))}
    return out


def _row(r: dict[str, Any]) -> dict[str, Any]:
    return {k: (int(r[k]) if k in ("tokens", "sequences") else float(r[k])) for k in STAT_KEYS}


def _empty() -> dict[str, Any]:
    return {k: (0 if k in ("tokens", "sequences") else None) for k in STAT_KEYS}


def _order(key: str):
    """Sort key of a group's labels: position buckets in order, temperatures and integer versions by value."""
    if key == "by_position":
        labels = position_labels()
        return labels.index
    if key == "by_temperature":
        return float
    if key == "by_weight_version":
        return lambda v: (0, int(v), "") if v.lstrip("-").isdigit() else (1, 0, v)
    return str


def worst_tokens(report: pa.Table | pl.DataFrame, n: int) -> pl.DataFrame:
    """The ``n`` tokens of largest ``|r|`` (ties: by sample id, source, then position), with the report's columns
    and ``diff``, ``abs_diff``, ``ratio`` (``exp(r)``, clamped as :func:`per_token`)."""
    keys = ["abs_diff", "sample_id", "source", "position"]
    df = per_token(report).sort(keys, descending=[True, False, False, False]).head(n)
    return df.select([*AUDIT_SCHEMA.names, "diff", "abs_diff", "ratio"])


def token_contexts(rows: pa.Table, worst: pl.DataFrame, tokenizer=None) -> list[dict[str, Any]]:
    """Each worst token (:func:`worst_tokens`) with its text and decoded context: ``before`` (the
    :data:`CONTEXT_BEFORE` tokens ahead of it, prompt included) and ``after`` (:data:`CONTEXT_AFTER`).

    ``rows``: the dataset rows of those samples, with ``sample_id``, ``prompt_tokens`` and ``response_tokens``
    (e.g. ``RolloutDataset.to_arrow().to_table(columns=..., filter=pc.field('sample_id').isin(ids))``).
    Without a tokenizer, texts are None. A sample missing from ``rows`` gets None contexts."""
    by_id = {r["sample_id"]: r for r in rows.select(["sample_id", "prompt_tokens", "response_tokens"]).to_pylist()}
    out = []
    for w in worst.iter_rows(named=True):
        item = {k: w[k] for k in ("sample_id", "agent", "source", "position", "token", "rollout_logprob",
                                  "trainer_logprob", "diff", "ratio", "temperature", "weight_version")}
        row = by_id.get(w["sample_id"])
        text = before = after = None
        if tokenizer is not None:
            text = tokenizer.decode([w["token"]], skip_special_tokens=False)
        if row is not None and tokenizer is not None:
            ids = list(row["prompt_tokens"]) + list(row["response_tokens"])
            at = len(row["prompt_tokens"]) + w["position"]
            before = tokenizer.decode(ids[max(0, at - CONTEXT_BEFORE) : at], skip_special_tokens=False)
            after = tokenizer.decode(ids[at + 1 : at + 1 + CONTEXT_AFTER], skip_special_tokens=False)
        out.append({**item, "text": text, "before": before, "after": after})
    return out


# -- the file ------------------------------------------------------------------------------------


def _filesystem(path: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    text = os.fspath(path)
    if "://" in text:
        try:
            return pafs.FileSystem.from_uri(text)
        except (pa.ArrowInvalid, ValueError) as e:
            raise ValueError(f"cannot open {text!r}: {e}") from e
    return pafs.LocalFileSystem(), str(Path(text).expanduser().resolve())


def check_destination(path: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse, in one line (ValueError), a ``path`` :func:`write_audit` could not write: a folder, or one whose
    parent folder (for S3 and GCS: bucket) is missing or cannot be reached. Checked before the work that makes
    the report, not after it."""
    text = os.fspath(path)
    if "://" not in text:
        p = Path(text).expanduser()
        if p.is_dir():
            raise ValueError(f"{flag} {text} is a folder; name the report file, e.g. {flag} {p / 'audit.parquet'}")
        if not p.parent.resolve().is_dir():
            raise ValueError(f"{flag} {text}: no folder {p.parent}; create it first or choose another path")
        return
    try:
        fs, where = pafs.FileSystem.from_uri(text)
    except (pa.ArrowInvalid, ValueError, OSError) as e:  # OSError: an S3 bucket whose region cannot be resolved
        raise ValueError(f"{flag} {text}: cannot open it ({one_line(e)}); check the bucket name, the endpoint "
                         "(AWS_ENDPOINT_URL) and your credentials") from e
    where = where.rstrip("/")
    if "/" not in where:
        raise ValueError(f"{flag} {text} names no file; name the report, e.g. {flag} {text.rstrip('/')}/audit.parquet")
    # An object store's folders exist only as key prefixes: what must exist there is the bucket.
    parent = where.split("/", 1)[0] if fs.type_name in ("s3", "gcs") else where.rsplit("/", 1)[0] or "/"
    try:
        parent_info, info = fs.get_file_info([parent, where])
    except OSError as e:
        raise ValueError(f"{flag} {text}: cannot reach {parent} ({one_line(e)}); check the bucket name, the "
                         "endpoint (AWS_ENDPOINT_URL) and your credentials") from e
    if parent_info.type != pafs.FileType.Directory:
        kind = "bucket" if fs.type_name in ("s3", "gcs") else "folder"
        raise ValueError(f"{flag} {text}: no {kind} {parent}; create it first or choose another path")
    if info.type == pafs.FileType.Directory:
        raise ValueError(f"{flag} {text} is a folder; name the report file, e.g. "
                         f"{flag} {text.rstrip('/')}/audit.parquet")


def is_audit_report(path: str | os.PathLike) -> bool:
    """Whether the local file at ``path`` is an audit report :func:`write_audit` wrote (rewriting it is a rerun)."""
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException):  # not Parquet
        return False
    return META_AUDIT_VERSION in metadata


def write_audit(table: pa.Table, path: str | os.PathLike, *, datasets: list[AuditedDataset],
                metadata: dict[str, str] | None = None) -> str:
    """Write ``table`` (cast to :data:`AUDIT_SCHEMA`) to ``path`` (local or a pyarrow URI such as s3://)
    atomically. ``datasets`` names what was audited, one entry per value of the ``source`` column (at least);
    ``metadata`` (e.g. the model) is added to the file's key/value metadata. Returns the path written."""
    named = {d.source for d in datasets}
    unnamed = sorted(set(table.column("source").unique().to_pylist()) - named)
    if unnamed:
        raise ValueError(f"write_audit: source(s) {', '.join(unnamed)} of the report are not in datasets")
    extra = {**(metadata or {}), META_DATASETS.decode(): json.dumps([asdict(d) for d in datasets])}
    schema = AUDIT_SCHEMA.with_metadata({**(AUDIT_SCHEMA.metadata or {}), **{k.encode(): v.encode() for k, v in
                                                                           extra.items()}})
    table = table.select(AUDIT_SCHEMA.names).cast(schema)
    fs, where = _filesystem(path)
    if isinstance(fs, pafs.LocalFileSystem):
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        write_atomic(where, sink.getvalue().to_pybytes())
        return os.fspath(path)
    parent, name = where.rsplit("/", 1) if "/" in where else ("", where)
    tmp = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp" if parent else f".{name}.{uuid.uuid4().hex}.tmp"
    try:
        with fs.open_output_stream(tmp) as f:
            pq.write_table(table, f, compression="zstd")
        fs.move(tmp, where)
    except BaseException:
        try:
            fs.delete_file(tmp)
        except (FileNotFoundError, OSError):
            pass  # never created, or already moved: nothing left behind
        raise
    return os.fspath(path)


def read_audit(path: str | os.PathLike) -> pa.Table:
    """A report written by :func:`write_audit`; :class:`AuditSchemaError` (one line) for a file that is not one,
    is of a newer major version or cannot be read (an S3 bucket that does not exist), FileNotFoundError for a
    missing one."""
    try:
        fs, where = _filesystem(path)
        source = fs.open_input_file(where)
    except FileNotFoundError as e:  # pyarrow's says where in its own words: name the path as given
        raise FileNotFoundError(errno.ENOENT, "no such file", os.fspath(path)) from e
    except (OSError, ValueError) as e:
        raise AuditSchemaError(f"{path}: cannot read it ({one_line(e)}); check the path and your access to it") from e
    try:
        pf = pq.ParquetFile(source)
    except (OSError, pa.ArrowInvalid) as e:
        raise AuditSchemaError(f"{path}: not a Parquet file ({one_line(e)}); pass the file rollshard-train audit "
                               "--out wrote") from e
    meta = pf.schema_arrow.metadata or {}
    version = meta.get(META_AUDIT_VERSION, b"").decode()
    if not version:
        raise AuditSchemaError(f"{path}: no {META_AUDIT_VERSION.decode()} in its metadata; not an audit report "
                               "(write one with rollshard-train audit --out)")
    try:
        major = int(version.split(".")[0])
    except ValueError as e:
        raise AuditSchemaError(f"{path}: unreadable audit schema version {version!r}") from e
    if major > AUDIT_SCHEMA_MAJOR:
        raise AuditSchemaError(f"{path}: written with audit schema {version}, this rollshard reads "
                               f"{AUDIT_SCHEMA_MAJOR}.x; upgrade rollshard to read it")
    missing = [n for n in AUDIT_SCHEMA.names if n not in pf.schema_arrow.names]
    if missing:
        raise AuditSchemaError(f"{path}: audit report without column(s) {', '.join(missing)}")
    table = pf.read(columns=AUDIT_SCHEMA.names)
    try:
        audited_datasets(table)
    except ValueError as e:
        raise AuditSchemaError(f"{path}: {e}") from e
    return table


def audited_datasets(table: pa.Table) -> list[AuditedDataset] | None:
    """The datasets a report (:func:`read_audit`) was made of, one per source; None for a report of audit schema
    1.0, which does not say. ValueError for an unreadable entry."""
    raw = (table.schema.metadata or {}).get(META_DATASETS)
    if raw is None:
        return None
    try:
        return [AuditedDataset(**d) for d in json.loads(raw)]
    except (ValueError, TypeError) as e:
        raise ValueError(f"unreadable {META_DATASETS.decode()} in its metadata ({one_line(e)})") from e


def report_metadata(table: pa.Table) -> dict[str, str]:
    """The key/value metadata a report was written with (what was audited), as text."""
    return {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}



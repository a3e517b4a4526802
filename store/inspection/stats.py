"""Numbers about a dataset for ``rollshard-store stats`` and ``inspect``, computed with polars.

Totals (rows, groups, tokens, bytes) come from the manifests without reading data.
Breakdowns are polars lazy scans with column projection, collected together so the
shards are read once per column. Token lists are never read for their values: the
response length of a row is the length of its ``loss_mask`` (1 byte per token instead
of 4 for the ids; equal lengths are a schema invariant), and the trainable tokens are
the mask's sum.

Definitions (:mod:`rollshard.store.format.groups`, shared with the loader and the trainer):
reward statistics use the finite rewards only (a failed row may have none) and the
unbiased standard deviation (``REWARD_STD_DDOF``), as the trainer normalizes a group. A
zero-variance group has two or more rows whose finite rewards are all equal: every
advantage in it is 0, so it carries no learning signal. A single-member group (one
row, e.g. the selector) is counted apart: the trainer trains it on its reward.

Parse rates: an agent system may record in a row's metadata JSON what it could read of the
response, as a status string under one of :data:`PARSE_KEYS` (``multi_agent``:
``answer_status`` ``ok`` | ``missing`` on every row, and the selector's ``judgment_status``
``ok`` | ``out_of_range`` | ``missing``). Each agent's ``parse`` counts the rows by status per
key, over the rows that carry the key; a key no row of an agent carries is left out (datasets
written before these keys carry none; a ``rescore`` adds the selector's).
"""

from __future__ import annotations

import json

import math
import os
from typing import Any

import polars as pl

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.format.groups import REWARD_STD_DDOF, group_flags
from rollshard.store.format.lineage import lineage_of
from rollshard.store.format.routing import CONFIG_KEY as ROUTING_KEY
from rollshard.store.format.schema import STATUS_VALUES, Status

RESPONSE_LEN = pl.col("loss_mask").list.len().cast(pl.Int64)
TRAINABLE = pl.col("loss_mask").list.sum().cast(pl.Int64)
FINITE_REWARD = pl.col("reward").filter(pl.col("reward").is_finite())
# Where a run config may name the model whose tokenizer wrote the token ids, best first.
TOKENIZER_KEY_HINTS = ("tokenizer", "model", "path")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a folder holding one is a tokenizer folder
PARSE_KEYS = ("answer_status", "judgment_status")  # metadata keys holding a row's parse status (module docstring)
PARSE_OK = "ok"


def _reward_aggs() -> list[pl.Expr]:
    return [
        pl.len().alias("rows"),
        FINITE_REWARD.len().alias("reward_rows"),
        FINITE_REWARD.cast(pl.Float64).mean().alias("reward_mean"),
        FINITE_REWARD.cast(pl.Float64).std(ddof=REWARD_STD_DDOF).alias("reward_std"),
    ]


def dataset_stats(ds: RolloutDataset) -> dict[str, Any]:
    """Totals from the manifests; rows by status; rows, tokens and reward by agent."""
    lf = ds.scan()
    status, by_agent, supports, parsed, routed = pl.collect_all(
        [
            lf.group_by("status").agg(pl.len().alias("rows")),
            lf.group_by("agent")
            .agg(
                *_reward_aggs(),
                pl.col("group_id").n_unique().alias("groups"),
                RESPONSE_LEN.sum().alias("response_tokens"),
                TRAINABLE.sum().alias("trainable_tokens"),
            )
            .sort("agent"),
            lf.select(pl.col("sampling_support").is_not_null().sum().cast(pl.Int64).alias("rows")),
            _parse_counts(lf),
            lf.select(pl.col("routed_experts").is_not_null().sum().cast(pl.Int64).alias("rows")),
        ]
    )
    with_routing = int(routed["rows"][0]) if routed.height else 0
    shapes = sorted({json.dumps(m.config[ROUTING_KEY], sort_keys=True) for m in ds.manifests
                     if isinstance(m.config, dict) and m.config.get(ROUTING_KEY)})
    with_support = int(supports["rows"][0]) if supports.height else 0
    status_counts = {s: 0 for s in STATUS_VALUES}
    status_counts.update({r["status"]: r["rows"] for r in status.iter_rows(named=True)})
    agents = {}
    parse = _parse_by_agent(parsed)
    for r in by_agent.iter_rows(named=True):
        agent = r.pop("agent")
        agents[agent] = {**_clean(r), "parse": parse.get(agent, {})}
    return {
        "dataset": ds.storage.uri,
        "schema_version": ds.schema_version,
        "fingerprint": ds.fingerprint,
        "shards": len(ds.shards),
        "writers": len(ds.manifests),
        "rows": ds.num_rows,
        "groups": ds.num_groups,
        "prompt_tokens": ds.num_prompt_tokens,
        "response_tokens": ds.num_response_tokens,
        "tokens": ds.num_tokens,
        "bytes": ds.num_bytes,
        "status": status_counts,
        "agents": agents,
        # schema 1.1: rows that carry the sampling support of their tokens (none in a 1.0 dataset)
        "rows_with_support": with_support,
        "support_fraction": with_support / ds.num_rows if ds.num_rows else None,
        # schema 1.2: rows that carry their MoE routing, and the routing shapes the writers' configs name
        "rows_with_routing": with_routing,
        "routing": [json.loads(x) for x in shapes],
    }


def _parse_counts(lf: pl.LazyFrame) -> pl.LazyFrame:
    """Rows by agent, parse key and status (string values only; a row without the key is not counted)."""
    return (
        lf.select("agent", *(pl.col("metadata").str.json_path_match(f"$.{k}").alias(k) for k in PARSE_KEYS))
        .unpivot(index="agent", on=list(PARSE_KEYS), variable_name="key", value_name="status")
        .drop_nulls("status")
        .group_by("agent", "key", "status")
        .agg(pl.len().cast(pl.Int64).alias("rows"))
    )


def _parse_by_agent(counts: pl.DataFrame) -> dict[str, dict[str, Any]]:
    """``{agent: {key: {"rows", "counts": {status: rows}, "ok_share"}}}``, statuses ``ok`` first, then by name."""
    out: dict[str, dict[str, Any]] = {}
    for r in counts.sort("agent", "key", pl.col("status") != PARSE_OK, "status").iter_rows(named=True):
        entry = out.setdefault(r["agent"], {}).setdefault(r["key"], {"rows": 0, "counts": {}})
        entry["counts"][r["status"]] = r["rows"]
        entry["rows"] += r["rows"]
    for keys in out.values():
        for entry in keys.values():
            entry["ok_share"] = entry["counts"].get(PARSE_OK, 0) / entry["rows"]
    return out


def inspect_summary(ds: RolloutDataset) -> dict[str, Any]:
    """Everything ``rollshard-store inspect`` shows; ``["stats"]`` is :func:`dataset_stats`, ``["lineage"]``
    :func:`rollshard.store.format.lineage.lineage_of` (``[]`` unless the dataset was derived from another)."""
    lf = ds.scan()
    per_group = lf.group_by("group_id").agg(pl.col("agent").first(), *group_flags())
    finish, by_round, lengths, zero_var, versions, times = pl.collect_all(
        [
            lf.group_by("finish_reason").agg(pl.len().alias("rows")).sort("rows", descending=True),
            lf.group_by("agent", "round").agg(*_reward_aggs()).sort("agent", "round"),
            lf.select("agent", "status", RESPONSE_LEN.alias("n"))
            .group_by("agent")
            .agg(
                pl.len().alias("rows"),
                pl.col("n").mean().alias("mean"),
                pl.col("n").quantile(0.5, "nearest").cast(pl.Int64).alias("p50"),
                pl.col("n").quantile(0.9, "nearest").cast(pl.Int64).alias("p90"),
                pl.col("n").max().alias("max"),
                (pl.col("status") == Status.TRUNCATED.value).mean().alias("truncated_frac"),
            )
            .sort("agent"),
            per_group.group_by("agent")
            .agg(
                pl.len().alias("groups"),
                pl.col("zero_variance").sum().cast(pl.Int64).alias("zero_variance"),
                pl.col("single_member").sum().cast(pl.Int64).alias("single_member"),
            )
            .sort("agent"),
            lf.group_by("weight_version")
            .agg(pl.len().alias("rows"), (pl.col("weight_versions").list.len() > 1).sum().alias("multi_version_rows"))
            .sort("weight_version"),
            lf.select(pl.col("created_at").min().alias("first"), pl.col("created_at").max().alias("last")),
        ]
    )
    zv_by_agent = {
        r["agent"]: {**r, "fraction": r["zero_variance"] / r["groups"]} for r in zero_var.iter_rows(named=True)
    }
    for v in zv_by_agent.values():
        v.pop("agent")
    n_groups = sum(v["groups"] for v in zv_by_agent.values())
    n_zero = sum(v["zero_variance"] for v in zv_by_agent.values())
    n_single = sum(v["single_member"] for v in zv_by_agent.values())
    t = times.row(0, named=True) if times.height else {"first": None, "last": None}
    return {
        "stats": dataset_stats(ds),
        "config": ds.config,
        "lineage": lineage_of(ds),  # newest derivation first; [] for a generated dataset
        "writers": [
            {
                "writer_id": m.writer_id,
                "shards": len(m.shards),
                "rows": sum(s.rows for s in m.shards),
                "groups": sum(s.groups for s in m.shards),
                "tokens": sum(s.tokens for s in m.shards),
                "bytes": sum(s.bytes for s in m.shards),
            }
            for m in ds.manifests
        ],
        "finish_reason": {r["finish_reason"]: r["rows"] for r in finish.iter_rows(named=True)},
        "reward_by_agent_round": [_clean(r) for r in by_round.iter_rows(named=True)],
        "response_length": [_clean(r) for r in lengths.iter_rows(named=True)],
        "zero_variance_groups": {
            "groups": n_groups,
            "zero_variance": n_zero,
            "single_member": n_single,
            "fraction": n_zero / n_groups if n_groups else None,
            "by_agent": zv_by_agent,
        },
        "weight_version": [dict(r) for r in versions.iter_rows(named=True)],
        "created_at": {k: v.isoformat() if v is not None else None for k, v in t.items()},
    }


def find_sample(ds: RolloutDataset, sample_id: str) -> dict[str, Any] | None:
    """One row by ``sample_id`` (predicate pushed into the scan: row groups whose
    sample_id statistics exclude it are skipped), or None."""
    df = ds.scan().filter(pl.col("sample_id") == sample_id).head(1).collect()
    return df.row(0, named=True) if df.height else None


def tokenizer_path(config: dict[str, Any], base_dirs: list[str] | None = None) -> str | None:
    """A local tokenizer folder named anywhere in a run config (``tokenizer`` keys first, then
    ``model`` ones), or None; load it with :func:`rollshard.store.models.tokenizer.load_tokenizer`.

    A relative path (older datasets store the model path as given on the command line) is tried
    against the current directory, then each of ``base_dirs``; the first folder that holds a
    tokenizer is returned, absolute."""
    found: list[tuple[int, str]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, str):
                    rank = next((i for i, h in enumerate(TOKENIZER_KEY_HINTS) if h in str(k).lower()), None)
                    if rank is not None:
                        found.append((rank, v))
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(config)
    for _, path in sorted(found, key=lambda x: x[0]):
        path = os.path.expanduser(path)
        bases = [""] if os.path.isabs(path) or "://" in path else ["", *(base_dirs or [])]
        for base in bases:
            candidate = os.path.join(base, path)
            if any(os.path.isfile(os.path.join(candidate, f)) for f in TOKENIZER_FILES):
                return candidate if not base else os.path.abspath(candidate)
    return None


def decode_each(tokenizer, ids: list[int]) -> list[str]:
    """The text of each token on its own (byte-level pieces of one character may show as U+FFFD)."""
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    """NaN -> None so the dict is valid JSON."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()}

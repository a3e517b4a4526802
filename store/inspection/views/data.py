"""The numbers behind each view of a dataset, as polars frames: what the notebook displays and the report
prints as tables, and what its figures draw.

Definitions are the store's own: reward statistics over finite rewards with the trainer's ddof
(:mod:`rollshard.store.format.groups`), per-agent totals from :func:`rollshard.store.inspection.stats.dataset_stats` (so
the report's numbers are ``rollshard-store stats --json``'s), staleness by version (the
newest integer version minus the row's ``weight_version``; the trainer counts a multi-version row from its oldest).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Sequence

import polars as pl

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.format.groups import REWARD_STD_DDOF, group_flags
from rollshard.store.inspection.stats import dataset_stats

RESPONSE_LEN = pl.col("loss_mask").list.len()  # == len(response_tokens), a schema invariant
TRAINED = pl.col("loss_mask").list.sum()
FINITE_REWARD = pl.col("reward").filter(pl.col("reward").is_finite())  # failed rows may have none
_DIGITS = re.compile(r"(\d+)")


def natural_key(text: Any) -> tuple:
    """Sort key reading runs of digits as numbers: ``solver/0/10`` after ``solver/0/9``, not after ``/1``."""
    parts = _DIGITS.split("" if text is None else str(text))
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def natural_sorted(values: Iterable[Any]) -> list:
    return sorted(values, key=natural_key)


def agent_order(lf: pl.LazyFrame) -> list[str]:
    """Agents in pipeline order: the first round each acts in, then by name."""
    return lf.group_by("agent").agg(pl.col("round").min()).sort("round", "agent").collect()["agent"].to_list()


def _by_agents(df: pl.DataFrame, agents: Sequence[str]) -> pl.DataFrame:
    order = {a: i for i, a in enumerate(agents)}
    return df.sort(pl.col("agent").replace_strict(order, default=len(order), return_dtype=pl.Int64))


def overview(ds: RolloutDataset) -> pl.DataFrame:
    fields = {
        "dataset": ds.storage.uri,
        "schema version": ds.schema_version,
        "fingerprint": ds.fingerprint,
        "writers": len(ds.manifests),
        "shards": len(ds.shards),
        "rows": ds.num_rows,
        "groups": ds.num_groups,
        "prompt tokens": ds.num_prompt_tokens,
        "response tokens": ds.num_response_tokens,
        "bytes on disk": ds.num_bytes,
    }
    values = [f"{v:,}" if isinstance(v, int) else str(v) for v in fields.values()]
    return pl.DataFrame({"field": list(fields), "value": values})


def status_counts(lf: pl.LazyFrame) -> pl.DataFrame:
    return (
        lf.group_by("status").agg(pl.len().alias("rows"))
        .with_columns(share=pl.col("rows") / pl.col("rows").sum())
        .sort("rows", "status", descending=[True, False])
        .collect()
    )


def per_agent(ds: RolloutDataset, agents: Sequence[str] | None = None) -> pl.DataFrame:
    """Rows, groups, tokens and reward by agent: exactly ``rollshard-store stats --json``'s ``agents``."""
    st = dataset_stats(ds)["agents"]
    rows = [{"agent": a, **{k: x for k, x in v.items() if k != "parse"}} for a, v in st.items()]
    schema = {"agent": pl.String, "rows": pl.Int64, "reward_rows": pl.Int64, "reward_mean": pl.Float64,
              "reward_std": pl.Float64, "groups": pl.Int64, "response_tokens": pl.Int64, "trainable_tokens": pl.Int64}
    df = pl.DataFrame(rows, schema=schema).select(
        "agent", "rows", "groups", "response_tokens", "trainable_tokens", "reward_rows", "reward_mean", "reward_std"
    )
    return _by_agents(df, agents or natural_sorted(st))


def parse_rates(ds: RolloutDataset, agents: Sequence[str] | None = None) -> pl.DataFrame:
    """What each agent's responses parsed to: ``rollshard-store stats --json``'s ``agents[...]["parse"]``, one row per
    agent, parse key (``answer_status``, the selector's ``judgment_status``) and status, with the status's share of
    the agent's rows that carry the key. Empty when no row records a parse status."""
    st = dataset_stats(ds)["agents"]
    order = list(agents or []) + [a for a in natural_sorted(st) if a not in (agents or [])]
    rows = [{"agent": a, "key": key, "status": status, "rows": n, "share": n / entry["rows"]}
            for a in order if a in st
            for key, entry in st[a]["parse"].items() for status, n in entry["counts"].items()]
    schema = {"agent": pl.String, "key": pl.String, "status": pl.String, "rows": pl.Int64, "share": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def finite_rewards(lf: pl.LazyFrame) -> pl.DataFrame:
    return lf.select("agent", "round", "reward").filter(pl.col("reward").is_finite()).collect()


def reward_by_round(rewards: pl.DataFrame, agents: Sequence[str]) -> pl.DataFrame:
    """Mean and std (the trainer's ddof) of the finite rewards by agent and round (the agent system's step)."""
    df = rewards.group_by("agent", "round").agg(
        pl.len().alias("rows"),
        pl.col("reward").cast(pl.Float64).mean().alias("mean"),
        pl.col("reward").cast(pl.Float64).std(ddof=REWARD_STD_DDOF).alias("std"),
    )
    return _by_agents(df, agents).sort("round", maintain_order=True)


def rewards_across(datasets: Sequence[RolloutDataset], names: Sequence[str] | None = None) -> pl.DataFrame:
    """Reward by agent in each dataset, the datasets read as consecutive training rounds (0, 1, ...)."""
    frames = []
    for i, ds in enumerate(datasets):
        name = names[i] if names else ds.storage.uri
        for agent, a in dataset_stats(ds)["agents"].items():
            frames.append({"round": i, "dataset": name, "agent": agent, "rows": a["rows"],
                           "reward_rows": a["reward_rows"], "mean": a["reward_mean"], "std": a["reward_std"]})
    schema = {"round": pl.Int64, "dataset": pl.String, "agent": pl.String, "rows": pl.Int64,
              "reward_rows": pl.Int64, "mean": pl.Float64, "std": pl.Float64}
    return pl.DataFrame(frames, schema=schema).sort("round", "agent")


def groups(lf: pl.LazyFrame, agents: Sequence[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Per group (agent, size, flags) and per agent: groups, zero-variance ones, their fraction, single-member."""
    per_group = lf.group_by("group_id").agg(pl.col("agent").first(), pl.len().alias("size"), *group_flags()).collect()
    by_agent = per_group.group_by("agent").agg(
        pl.len().alias("groups"),
        pl.col("zero_variance").sum().alias("zero_variance"),
        pl.col("zero_variance").mean().alias("fraction"),
        pl.col("single_member").sum().alias("single_member"),
    )
    return per_group, _by_agents(by_agent, agents)


def lengths(lf: pl.LazyFrame) -> pl.DataFrame:
    return lf.select("agent", "status", "finish_reason", RESPONSE_LEN.alias("length")).collect()


def length_summary(lens: pl.DataFrame, agents: Sequence[str]) -> pl.DataFrame:
    df = lens.group_by("agent").agg(
        pl.len().alias("rows"),
        pl.col("length").mean().alias("mean"),
        pl.col("length").median().alias("median"),
        pl.col("length").max().alias("max"),
        (pl.col("status") == "truncated").mean().alias("truncation_rate"),
    )
    return _by_agents(df, agents)


def logprob_by_agent(lf: pl.LazyFrame, agents: Sequence[str]) -> pl.DataFrame:
    """Mean rollout logprob of the trained tokens by agent (tool tokens carry 0.0, so a row's sum is its trained
    tokens' sum), and its negative, the mean surprise of the sampled tokens (an entropy proxy)."""
    df = (
        lf.group_by("agent")
        .agg(
            pl.col("rollout_logprobs").list.sum().sum().alias("logprob_sum"),
            TRAINED.sum().alias("trained_tokens"),
            (RESPONSE_LEN - TRAINED).sum().alias("masked_tokens"),
        )
        .with_columns(mean_logprob=pl.col("logprob_sum") / pl.col("trained_tokens"))
        .with_columns(entropy_proxy=-pl.col("mean_logprob"))
        .collect()
    )
    return _by_agents(df, agents)


def trained_tokens(lf: pl.LazyFrame, max_rows: int) -> pl.DataFrame:
    """One row per trained token (loss_mask 1) of the first ``max_rows`` rows."""
    return (
        lf.head(max_rows)
        .select("sample_id", "agent", "response_tokens", "rollout_logprobs", "loss_mask",
                pl.int_ranges(0, RESPONSE_LEN).alias("pos"))
        .explode("response_tokens", "rollout_logprobs", "loss_mask", "pos")
        .filter(pl.col("loss_mask") == 1)
        .collect()
    )


def row_mean_logprob(lf: pl.LazyFrame) -> pl.DataFrame:
    return (
        lf.select("agent", (pl.col("rollout_logprobs").list.sum() / TRAINED).alias("mean_logprob"))
        .filter(pl.col("mean_logprob").is_finite())
        .collect()
    )


def staleness_counts(lf: pl.LazyFrame, current: int | None = None) -> pl.DataFrame:
    """Rows by weight_version and agent, with each version's staleness.

    Staleness is ``current - int(weight_version)``, as the trainer and the loader's ``max_staleness`` count a
    single-version row (a multi-version row they count from its oldest token's version); ``current`` defaults to the newest integer version present. A version that is not an integer has no
    staleness (null). Versions come in their natural order (``2`` before ``10``)."""
    df = (
        lf.group_by("weight_version", "agent")
        .agg(
            pl.len().alias("rows"),
            FINITE_REWARD.cast(pl.Float64).mean().alias("reward_mean"),
            (pl.col("weight_versions").list.len() > 1).sum().cast(pl.Int64).alias("multi_version_rows"),
        )
        .collect()
    )
    as_int = df["weight_version"].cast(pl.Int64, strict=False)
    newest = current if current is not None else as_int.max()
    df = df.with_columns(staleness=(pl.lit(newest, pl.Int64) - as_int) if newest is not None else pl.lit(None, pl.Int64))
    order = {v: i for i, v in enumerate(natural_sorted(df["weight_version"].unique().to_list()))}
    return df.sort(pl.col("weight_version").replace_strict(order, return_dtype=pl.Int64), "agent")


def version_totals(counts: pl.DataFrame) -> pl.DataFrame:
    """:func:`staleness_counts` summed over agents, one row per version in the same order."""
    return counts.group_by("weight_version", maintain_order=True).agg(
        pl.col("staleness").first(), pl.col("rows").sum(), pl.col("multi_version_rows").sum()
    )


def pick_sample(lf: pl.LazyFrame, sample_id: str | None = None) -> dict[str, Any]:
    """One row: ``sample_id``'s, else the first with a masked (tool) token, else the first."""
    if sample_id is None:
        masked = lf.filter(pl.col("loss_mask").list.min() == 0).select("sample_id").head(1).collect()
        first = masked if masked.height else lf.select("sample_id").head(1).collect()
        if not first.height:
            raise ValueError("the dataset has no rows")
        sample_id = first["sample_id"][0]
    df = lf.filter(pl.col("sample_id") == sample_id).head(1).collect()
    if not df.height:
        raise ValueError(f"no sample_id {sample_id!r} in the dataset")
    return df.row(0, named=True)


def pick_episode_prompt(lf: pl.LazyFrame) -> str | None:
    """The prompt with the most agents, then the most distinct rewards (an episode where the agents disagree)."""
    df = (
        lf.group_by("prompt_id")
        .agg(pl.col("agent").n_unique().alias("agents"), FINITE_REWARD.n_unique().alias("rewards"),
             pl.len().alias("rows"))
        .sort("agents", "rewards", "rows", "prompt_id", descending=[True, True, True, False])
        .head(1)
        .collect()
    )
    return df["prompt_id"][0] if df.height else None


def episode(lf: pl.LazyFrame, prompt_id: str) -> list[dict[str, Any]]:
    """Every row of one prompt in round order, sample ids in natural order, with the multi-agent metadata
    (``answer``, ``candidates``, and the selector's ``judgment`` and ``selected``) parsed out."""
    df = (
        lf.filter(pl.col("prompt_id") == prompt_id)
        .select("round", "agent", "sample_id", "prompt_id", "group_id", "reward", "status", "prompt_text", "response_text",
                "metadata", RESPONSE_LEN.alias("length"),
                (pl.col("rollout_logprobs").list.sum() / TRAINED).alias("mean_logprob"))
        .collect()
    )
    rows = []
    for r in df.iter_rows(named=True):
        try:
            meta = json.loads(r["metadata"]) if r["metadata"] else {}
        except ValueError:
            meta = {}
        r["meta"] = meta if isinstance(meta, dict) else {}
        rows.append(r)
    rows.sort(key=lambda r: (r["round"], natural_key(r["agent"]), natural_key(r["sample_id"])))
    return rows


def episode_table(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """:func:`episode` as a table: one agent call a row, what it answered and, for the selector, its pick."""
    picked = {r["meta"].get("selected") for r in rows if r["agent"] == "selector"} - {None}
    out = []
    for r in rows:
        m = r["meta"]
        note = ""
        if "judgment" in m:
            note = (f"Judgment: {m['judgment']} -> {m.get('selected')}" if m.get("judgment")
                    else f"no valid Judgment ({m.get('judgment_status', 'malformed')})")
        elif r["sample_id"] in picked:
            note = "picked by the selector"
        answer = m.get("answer") if "answer" in m else r["response_text"]
        out.append({"round": r["round"], "agent": r["agent"], "sample_id": r["sample_id"], "reward": r["reward"],
                    "status": r["status"], "length": r["length"], "pick": note,
                    "answer": None if answer is None else str(answer)[:120]})
    schema = {"round": pl.Int64, "agent": pl.String, "sample_id": pl.String, "reward": pl.Float64,
              "status": pl.String, "length": pl.Int64, "pick": pl.String, "answer": pl.String}
    return pl.DataFrame(out, schema=schema)

"""Synthetic rollout rows with realistic shapes, for benchmarks and tests.

Lengths, token ids and logprobs are drawn to look like a real policy's rollouts:
prompts of 200-1,000 tokens, responses of 100-4,000, Zipf-distributed token ids over
a 150k vocabulary, and logprobs mostly near 0 with a tail down to -20.

With ``top_k``, every row carries a schema 1.1 sampling support: the sampled token plus
``top_k - 1`` other distinct ids drawn from the same Zipf vocabulary (the likely tokens of a
real top-k set are the frequent ones), in ascending id order (SGLang gives them in descending
probability order, which the store's duplicate check has to sort: bench figures on these are its fast path),
and a sampling logprob ``log(p / Z)`` with the support's mass ``Z`` between ``p`` and 1.
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa

from rollshard.store.format.schema import ROW_SCHEMA, WEIGHT_SPAN

VOCAB = 151_936


def synthetic_table(
    n_groups: int,
    group_size: int = 8,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (200, 1000),
    response_len: tuple[int, int] = (100, 4000),
    agents: tuple[str, ...] = ("policy",),
    uneven_groups: bool = False,
    weight_versions: tuple[str, ...] = ("0",),
    prefix: str = "",
    top_k: int | None = None,
) -> pa.Table:
    """A table of ``ROW_SCHEMA`` rows: ``n_groups`` whole groups, rows of a group contiguous."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {n: [] for n in ROW_SCHEMA.names}
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    for g in range(n_groups):
        size = int(rng.integers(1, 2 * group_size)) if uneven_groups else group_size
        agent = agents[g % len(agents)]
        prompt = _tokens(rng, int(rng.integers(*prompt_len)))
        version = weight_versions[int(rng.integers(len(weight_versions)))]
        for i in range(size):
            n = int(rng.integers(*response_len))
            resp = _tokens(rng, n)
            # Most sampled tokens are near-certain; a heavy tail of unlikely ones.
            lp = -rng.exponential(0.3, n).astype(np.float32)
            tail = rng.random(n) < 0.02
            lp[tail] = -rng.uniform(2, 20, int(tail.sum())).astype(np.float32)
            mask = np.ones(n, np.uint8)
            cols["sample_id"].append(f"{prefix}p{g}-{agent}-0-{i}")
            cols["prompt_id"].append(f"{prefix}p{g}")
            cols["group_id"].append(f"{prefix}p{g}/{agent}/0")
            cols["agent"].append(agent)
            cols["round"].append(0)
            cols["prompt_tokens"].append(prompt)
            cols["response_tokens"].append(resp)
            cols["rollout_logprobs"].append(lp)
            cols["loss_mask"].append(mask)
            cols["reward"].append(float(rng.random() < 0.5))
            truncated = n >= response_len[1] - 1
            cols["status"].append("truncated" if truncated else "completed")
            cols["finish_reason"].append("length" if truncated else "stop")
            cols["weight_version"].append(version)
            cols["weight_versions"].append([{"version": version, "start": 0, "end": n}])
            cols["temperature"].append(1.0)
            cols["top_p"].append(1.0)
            cols["top_k"].append(-1 if top_k is None else top_k)
            cols["prompt_text"].append(None)
            cols["response_text"].append(None)
            cols["metadata"].append('{"task": "synthetic"}')
            cols["created_at"].append(now)
            cols["routed_experts"].append(None)
            if top_k is None:
                cols["sampling_logprobs"].append(None)
                cols["sampling_support"].append(None)
            else:
                cols["sampling_logprobs"].append(_sampling_logprobs(rng, lp))
                cols["sampling_support"].append(synthetic_supports(rng, resp, top_k))
    arrays = []
    for f in ROW_SCHEMA:
        if f.name in ("prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask"):
            arrays.append(_list_array(cols[f.name], f.type.value_type))
        elif f.name == "sampling_support":
            arrays.append(_support_array(cols[f.name]))
        elif f.name == "sampling_logprobs":
            arrays.append(_list_array(cols[f.name], f.type.value_type, nullable=True))
        elif f.name == "weight_versions":
            arrays.append(pa.array(cols[f.name], type=pa.list_(WEIGHT_SPAN)))
        else:
            arrays.append(pa.array(cols[f.name], type=f.type))
    return pa.Table.from_arrays(arrays, schema=ROW_SCHEMA)


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.zipf(1.2, n) % VOCAB).astype(np.int32)


def synthetic_supports(rng: np.random.Generator, sampled: np.ndarray, k: int) -> np.ndarray:
    """``[n, k]`` int32: per sampled id, ``k`` distinct ids in ascending order, the sampled one among them."""
    n = len(sampled)
    x = np.minimum(rng.zipf(1.2, (n, k - 1)) % VOCAB, VOCAB - k).astype(np.int64)
    x = np.sort(np.concatenate([x, sampled[:, None].astype(np.int64)], axis=1), axis=1)
    j = np.arange(k)
    y = np.maximum.accumulate(x - j, axis=1) + j  # strictly increasing: a repeated id moves up (still < VOCAB)
    missing = ~(y == sampled[:, None]).any(axis=1)  # the sampled id moved up: put it back in place of another
    y[missing, rng.integers(0, k, n)[missing]] = sampled[missing]
    return np.sort(y, axis=1).astype(np.int32)


def _sampling_logprobs(rng: np.random.Generator, lp: np.ndarray) -> np.ndarray:
    p = np.exp(lp.astype(np.float64))
    mass = p + (1 - p) * rng.uniform(0.5, 1.0, len(p))  # the support's share of the full distribution
    return np.minimum(lp - np.log(mass), 0.0).astype(np.float32)


def _list_array(values: list, value_type: pa.DataType, nullable: bool = False) -> pa.ListArray:
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum([0 if v is None else len(v) for v in values], out=offsets[1:])
    present = [v for v in values if v is not None]
    flat = np.concatenate(present) if present else np.zeros(0)
    mask = pa.array([v is None for v in values]) if nullable and len(present) < len(values) else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type), mask=mask)


def _support_array(values: list[np.ndarray | None]) -> pa.ListArray:
    """Rows of ``[n, k]`` supports (or None) -> list<list<int32>>."""
    if all(v is None for v in values):
        return pa.nulls(len(values), ROW_SCHEMA.field("sampling_support").type)
    present = [v for v in values if v is not None]
    sizes = np.concatenate([np.full(len(v), v.shape[1], np.int32) for v in present])  # [tokens]
    in_off = np.zeros(len(sizes) + 1, np.int32)
    np.cumsum(sizes, out=in_off[1:])
    tokens = pa.ListArray.from_arrays(pa.array(in_off), pa.array(np.concatenate([v.ravel() for v in present])))
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum([0 if v is None else len(v) for v in values], out=offsets[1:])
    mask = pa.array([v is None for v in values]) if len(present) < len(values) else None
    return pa.ListArray.from_arrays(pa.array(offsets), tokens, mask=mask)

"""Synthetic rollout rows with realistic shapes, for benchmarks and tests.

Lengths, token ids and logprobs are drawn to look like a real policy's rollouts:
prompts of 200-1,000 tokens, responses of 100-4,000, Zipf-distributed token ids over
a 150k vocabulary, and logprobs mostly near 0 with a tail down to -20.
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa

from rollshard.store.schema import ROW_SCHEMA, WEIGHT_SPAN

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
            cols["top_k"].append(-1)
            cols["prompt_text"].append(None)
            cols["response_text"].append(None)
            cols["metadata"].append('{"task": "synthetic"}')
            cols["created_at"].append(now)
    arrays = []
    for f in ROW_SCHEMA:
        if f.name in ("prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask"):
            arrays.append(_list_array(cols[f.name], f.type.value_type))
        elif f.name == "weight_versions":
            arrays.append(pa.array(cols[f.name], type=pa.list_(WEIGHT_SPAN)))
        else:
            arrays.append(pa.array(cols[f.name], type=f.type))
    return pa.Table.from_arrays(arrays, schema=ROW_SCHEMA)


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.zipf(1.2, n) % VOCAB).astype(np.int32)


def _list_array(values: list[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    flat = np.concatenate(values) if values else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))

"""The embedded engine's running batch: rows, their KV cache, attention mask and positions, and its reshaping.

The scheduler (:mod:`.embedded`) prefills new rows left-padded, merges them into the
running batch and drops finished rows; these helpers do the tensor work, and hide the
transformers cache API, which changed between 4.x and 5.x (``DynamicCache.layers``
replaced ``key_cache``/``value_cache``; ``cache`` replaced ``past_key_values`` in
model outputs).
"""

from __future__ import annotations

from typing import Any

import torch


class Batch:
    """The running batch: request rows, their KV cache, attention mask and next positions."""

    def __init__(self) -> None:
        self.rows: list[Any] = []  # the scheduler's requests, one per batch row
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer ([B, H, L, D], [B, H, L, D])
        self.mask = torch.zeros(0, 0, dtype=torch.bool)  # [B, L]
        self.pos = torch.zeros(0, dtype=torch.long)  # [B] position id of the next input token
        self.last = torch.zeros(0, dtype=torch.long)  # [B] next input token


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) of a transformers cache."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def out_cache(out):
    """The cache a model forward returned."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """A transformers DynamicCache holding ``kv``."""
    from transformers import DynamicCache

    if hasattr(DynamicCache, "from_legacy_cache"):
        return DynamicCache.from_legacy_cache(tuple(kv))
    return DynamicCache(kv)


def left_pad(t: torch.Tensor, length: int, dim: int, value=0) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.full(shape, value, dtype=t.dtype, device=t.device), t], dim=dim)


def merge(a: Batch, b: Batch) -> Batch:
    """``a``'s rows then ``b``'s, both left-padded to the longer cache."""
    if not a.rows:
        return b
    length = max(a.mask.shape[1], b.mask.shape[1])
    m = Batch()
    m.rows = a.rows + b.rows
    m.mask = torch.cat([left_pad(a.mask, length, 1, False), left_pad(b.mask, length, 1, False)])
    m.kv = [
        (
            torch.cat([left_pad(ka, length, 2), left_pad(kb, length, 2)]),
            torch.cat([left_pad(va, length, 2), left_pad(vb, length, 2)]),
        )
        for (ka, va), (kb, vb) in zip(a.kv, b.kv)
    ]
    m.pos = torch.cat([a.pos, b.pos])
    m.last = torch.cat([a.last, b.last])
    return m


def select(batch: Batch, keep: list[int]) -> Batch:
    """The rows ``keep`` of ``batch``, with the columns that became padding in every row cut off."""
    if len(keep) == len(batch.rows):
        return batch
    out = Batch()
    out.rows = [batch.rows[i] for i in keep]
    if not keep:
        return out
    idx = torch.tensor(keep, dtype=torch.long, device=batch.mask.device)
    mask = batch.mask[idx]  # [B', L]
    start = int((mask.any(dim=0).long().cumsum(0) == 0).sum())  # leading columns that are padding in every row
    out.mask = mask[:, start:]
    out.kv = [(k[idx, :, start:], v[idx, :, start:]) for k, v in batch.kv]
    out.pos, out.last = batch.pos[idx], batch.last[idx]
    return out

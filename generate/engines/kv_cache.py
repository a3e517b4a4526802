"""The embedded engine's KV cache: preallocated column buffers that a decode step writes one column of.

Layout: per layer, keys and values ``[B, H, C, D]`` of capacity C columns, of which the
first ``n`` are in use. Rows are left-padded, so every row's next token goes to the same
column ``n``: a decode step writes that column in place and attends to the view
``[:, :, :n + 1]``, where transformers' ``DynamicCache`` concatenates the whole cache
into a new tensor at every step (a copy of the cache per token, the largest cost of a
decode step on small models). The padding columns of a row are masked by an additive
mask ``[B, 1, 1, C]`` (0 attend, the dtype's minimum not), passed to the model as a
prepared 4-D mask, so transformers builds none per step (a model with sliding-window
layers gets it as a 2-D mask: see :func:`full_attention_only`).

The buffers are reshaped only when the batch changes: :func:`merge` (rows admitted after
their prefill) and :func:`select` (finished rows dropped, and the leading columns that
became padding in every row cut off) copy them once; :func:`reserve` grows the capacity
by :data:`GROW_COLUMNS` at a time.

:class:`ColumnCache` is the transformers ``Cache`` the model sees for one decode step. It
subclasses ``DynamicCache`` for the methods a model may call besides ``update``, and hides
the cache API, which changed between 4.x and 5.x (``DynamicCache.layers`` replaced
``key_cache``/``value_cache``; ``cache`` replaced ``past_key_values`` in model outputs).
"""

from __future__ import annotations

import torch

GROW_COLUMNS = 256  # columns added when a batch's buffers are full: one copy of the cache per this many steps


class KV:
    """Column buffers of a running batch: ``keys``/``values`` per layer ``[B, H, C, D]``, ``n`` columns used,
    ``mask`` ``[B, 1, 1, C]`` additive (0 where a row attends, the dtype's minimum on its padding)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, n: int) -> None:
        self.keys, self.values, self.mask, self.n = keys, values, mask, n

    @property
    def capacity(self) -> int:
        return self.mask.shape[-1]


def column_cache(kv: KV):
    """The transformers cache a decode step runs on: its ``update`` writes column ``kv.n`` of ``kv``'s buffers
    and returns the views ``[:, :, :n + 1]``; ``kv.n`` advances once the last layer has written."""
    return column_cache_class()(kv)


_CLASS = None


def column_cache_class():
    """Built on first use, so importing this module does not import transformers."""
    global _CLASS
    if _CLASS is None:
        from transformers import DynamicCache

        class ColumnCache(DynamicCache):
            def __init__(self, kv: KV) -> None:
                super().__init__()
                self.kv = kv

            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                kv, n = self.kv, self.kv.n
                keys, values = kv.keys[layer_idx], kv.values[layer_idx]  # [B, H, C, D]
                keys[:, :, n : n + 1] = key_states  # [B, H, 1, D]
                values[:, :, n : n + 1] = value_states
                if layer_idx == len(kv.keys) - 1:
                    kv.n = n + 1
                return keys[:, :, : n + 1], values[:, :, : n + 1]

            def get_seq_length(self, layer_idx: int = 0) -> int:
                return self.kv.n

            def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
                return self.kv.n + 1, 0

        _CLASS = ColumnCache
    return _CLASS


def full_attention_only(config) -> bool:
    """Whether every layer of a model attends to the whole context, so one prepared 4-D mask serves them all.
    A model with sliding-window layers gets the 2-D padding mask instead, from which transformers builds each
    layer type's mask (the cache's ``get_mask_sizes`` gives it the columns)."""
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return types == {"full_attention"} and not window


def prefill_cache():
    """An empty cache for a prefill that keeps every layer's whole context. The one a model builds itself keeps
    only the last window of a sliding-window layer, which the column buffers cannot line up with the others."""
    from transformers import DynamicCache

    return DynamicCache()


def repeated(cache, rows: int):
    """A prefill cache holding a one-row cache's keys and values for each of ``rows`` rows (a shared prefix's)."""
    out = prefill_cache()
    for i, (k, v) in enumerate(cache_tensors(cache)):  # [1, H, L, D] each
        out.update(k.expand(rows, -1, -1, -1).contiguous(), v.expand(rows, -1, -1, -1).contiguous(), i)
    return out


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) of a transformers cache."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def out_cache(out):
    """The cache a model forward returned."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def from_prefill(
    layers: list[tuple[torch.Tensor, torch.Tensor]],  # per layer ([n, H, L, D], [n, H, L, D]) of a left-padded prefill
    valid: torch.Tensor,  # [n, L] bool: real prompt tokens
    dtype: torch.dtype,  # of the additive mask: the keys' (attention takes a mask of the query's dtype)
    reserve_columns: int,  # capacity beyond the L columns
) -> KV:
    """Column buffers holding a prefill's cache, its padding slots zeroed (a NaN there cannot leak through 0 * NaN)."""
    rows, length = valid.shape
    cap = length + max(reserve_columns, 0)
    keep = valid[:, None, :, None]  # [n, 1, L, 1]
    keys, values = [], []
    for k, v in layers:
        kb = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])  # [n, H, C, D]
        vb = v.new_zeros(v.shape[0], v.shape[1], cap, v.shape[3])
        kb[:, :, :length] = torch.where(keep, k, 0.0)
        vb[:, :, :length] = torch.where(keep, v, 0.0)
        keys.append(kb)
        values.append(vb)
    mask = torch.zeros(rows, 1, 1, cap, dtype=dtype, device=valid.device)  # [n, 1, 1, C]
    mask[:, 0, 0, :length].masked_fill_(~valid, torch.finfo(dtype).min)
    return KV(keys, values, mask, length)


def merge(a: KV, b: KV, reserve_columns: int) -> KV:
    """``a``'s rows then ``b``'s, right-aligned on their last used column (left padding added to the shorter)."""
    n = max(a.n, b.n)
    cap = n + max(reserve_columns, a.capacity - a.n, b.capacity - b.n, 0)
    rows_a = a.mask.shape[0]

    def joined(ta: torch.Tensor, tb: torch.Tensor) -> torch.Tensor:  # [Ba, H, Ca, D], [Bb, H, Cb, D]
        out = ta.new_zeros(rows_a + tb.shape[0], ta.shape[1], cap, ta.shape[3])  # [B, H, C, D]
        out[:rows_a, :, n - a.n : n] = ta[:, :, : a.n]
        out[rows_a:, :, n - b.n : n] = tb[:, :, : b.n]
        return out

    mask = a.mask.new_zeros(rows_a + b.mask.shape[0], 1, 1, cap)  # [B, 1, 1, C]
    minimum = torch.finfo(mask.dtype).min
    for rows, src in ((slice(0, rows_a), a), (slice(rows_a, None), b)):
        mask[rows, :, :, : n - src.n] = minimum  # the new left padding
        mask[rows, :, :, n - src.n : n] = src.mask[:, :, :, : src.n]
    keys = [joined(ka, kb) for ka, kb in zip(a.keys, b.keys)]
    values = [joined(va, vb) for va, vb in zip(a.values, b.values)]
    return KV(keys, values, mask, n)


def select(kv: KV, keep: torch.Tensor) -> KV:
    """The rows ``keep`` ([B'] long) of ``kv``, with the leading columns that are padding in every kept row cut off."""
    padding = kv.mask.index_select(0, keep)[:, 0, 0, : kv.n] < 0  # [B', n]
    start = int(padding.all(dim=0).long().cumprod(0).sum())  # leading columns that are padding in every row
    # Sliced, then gathered: one copy, contiguous, so a decode step writes into a buffer of its own.
    keys = [k[:, :, start:].index_select(0, keep) for k in kv.keys]
    values = [v[:, :, start:].index_select(0, keep) for v in kv.values]
    return KV(keys, values, kv.mask[..., start:].index_select(0, keep), kv.n - start)


def reserve(kv: KV, columns: int) -> KV:
    """``kv`` with room for at least ``columns`` more columns (grown by :data:`GROW_COLUMNS` or more)."""
    if kv.n + columns <= kv.capacity:
        return kv
    cap = kv.n + max(columns, GROW_COLUMNS)
    rows = kv.mask.shape[0]

    def grown(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(t.shape[0], t.shape[1], cap, t.shape[3])
        out[:, :, : kv.n] = t[:, :, : kv.n]
        return out

    mask = kv.mask.new_zeros(rows, 1, 1, cap)
    mask[..., : kv.n] = kv.mask[..., : kv.n]
    return KV([grown(k) for k in kv.keys], [grown(v) for v in kv.values], mask, kv.n)

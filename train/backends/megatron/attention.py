"""Attention over packed sequences for megatron-core's layers: each sequence alone, causal, no ``[T, T]`` mask.

megatron-core's local ``DotProductAttention`` takes no packed-sequence parameters (THD is Transformer
Engine's): it would need a dense block-diagonal ``[T, T]`` mask and computes all ``T x T`` scores, most of
them masked, measured ~6x slower than the hf backend's per-sequence kernel on the tiny model.
:class:`PackedSequenceAttention` is that class with its ``forward`` replaced while a micro-batch's sequence
boundaries are set (:func:`packed_sequences`): torch's ``scaled_dot_product_attention``, causal, on each
sequence's slice, key/value heads repeated for grouped-query attention, the softmax scale megatron-core
computed. It is the core attention of every layer spec this backend builds (local and Transformer Engine),
so there is one attention path on every device. Outside :func:`packed_sequences` it is megatron-core's own
(``tests/train/test_megatron_attention.py`` holds the two equal on a block-diagonal mask).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

_BOUNDS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("packed_bounds", default=None)


@contextlib.contextmanager
def packed_sequences(cu_seqlens: torch.Tensor):
    """Within: the layers attend within each sequence of the micro-batch (``cu_seqlens [S+1]``, its boundaries;
    an empty sequence has nothing to attend and is skipped)."""
    cu = cu_seqlens.tolist()
    bounds = cu[:1] + [b for a, b in zip(cu[:-1], cu[1:]) if b != a]
    token = _BOUNDS.set(bounds)
    try:
        yield
    finally:
        _BOUNDS.reset(token)


class PackedSequenceAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        bounds = _BOUNDS.get()
        if bounds is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        # query [T, B, heads, d], key/value [T, B, groups, d] -> [B, heads, T, d]
        per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if per_group > 1:
            k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        parts = [
            F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=self.softmax_scale)
            for s, e in zip(bounds[:-1], bounds[1:])
        ]
        context = torch.cat(parts, dim=2)  # [B, heads, T, d]
        T, B = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(T, B, self.hidden_size_per_partition)  # [T, B, heads * d]

"""Varlen attention for packed micro-batches: each sequence attends to itself alone, without a ``[T, T]`` mask.

The trainer lays a micro-batch's sequences end to end in one row (``input_ids [1, T]``, ``position_ids``
restarting at 0 per sequence, no attention mask; ``store/loader/packing.py``). With ``sdpa`` or ``eager``,
transformers' ``masking_utils`` finds the restarts and builds a dense block-diagonal causal mask of
``T x T`` per forward (256 MiB of booleans at 16k tokens, which sdpa on CPU expands to an fp32 additive
mask), and attention computes all ``T^2`` scores, of which only ``sum(L^2) / 2`` are needed.

``rollshard_varlen`` (:data:`VARLEN`, registered with transformers' ``AttentionInterface`` and
``AttentionMaskInterface`` when this module is imported; ``rollshard.train.logprobs`` imports it) builds no
mask and splits ``q, k, v`` at the sequence boundaries, running
``scaled_dot_product_attention(is_causal=True)`` on each sequence: the forward of that sequence alone (the
same kernel, the same causal mask; equal to it to fp32 rounding, <= 1.5e-6 nats measured), ``O(max L^2)``
transient memory at most (CPU's and CUDA's fused sdpa kernels hold no scores at all), ``O(sum L^2)``
compute. The boundaries come from the ``position_ids`` the model passes down to its attention function
(GPT-2, Llama/Qwen and the other models of transformers' attention interface do), by ``masking_utils``' rule
(a new sequence wherever the position does not advance by 1), so it sees the sequences the dense mask would.
Grouped-query attention runs on sdpa's ``enable_gqa`` (no ``repeat_kv`` copy); a sliding window (Qwen2/3,
Mistral) runs in query tiles of the window, each against its band of keys (``O(window^2)`` mask and scores;
on CUDA the grouped heads are repeated there, since the fused kernels that take a mask do not take them). It
refuses, each with the fix, what it could not honour: a padding mask, a KV cache (decoding), multimodal
(3-D) position ids, attention-logit softcapping and attention sinks; it is the
trainer's packed forward, not a generation backend.

Measured (``tests/bench/bench_attention.py``, fp32 CPU, 2 threads, one micro-batch of 16,384 tokens in 29
sequences of 64-1024 tokens, forward + backward, two runs): tiny-qwen3 peaks at 3075-3118 MiB RSS with
sdpa's dense mask and 1031-1046 MiB with ``rollshard_varlen`` (2664-2706 and 620-634 MiB above the loaded
model), tiny-gpt2 at 3177-3241 and 1167-1188 MiB; the pass took 18-21 s against 1.5-2.9 s (qwen3) and 11-18
s against 0.6-2.8 s (gpt2) on a shared machine. In 2004 sequences of 1-16 tokens: 3032 against 1056 MiB.

Default (``--attn-implementation auto``, resolved by ``rollshard.train.config.default_attention``):

* ``flash_attention_2`` on a bf16 CUDA device with the ``flash_attn`` package installed: transformers calls
  its varlen kernel with ``cu_seqlens`` taken from the same position ids, the whole micro-batch in one
  launch per layer. It has no fp32 kernel, so the start-up check (``logprobs.check_model``) runs on sdpa.
* ``rollshard_varlen`` everywhere else (CPU; CUDA without flash-attn; fp32 compute): exact, no compile,
  every model of the attention interface. On CUDA its per-sequence calls run PyTorch's fused kernels, one
  launch per sequence and layer.
* Not ``flex_attention``: on CPU (torch 2.13) it has no backward ("FlexAttention does not support backward
  on CPU"); its forward, which transformers always compiles (inductor), took 13-18 s to compile on the first
  micro-batch and ~10 s again for each new micro-batch length (then 0.3-1.2 s for the 16k forward, varlen
  0.2-0.7 s); and transformers has no flex path for GPT-2. It stays selectable for the models that have one.

Shapes here: ``B`` batch rows (1 in the trainer), ``Hq`` / ``Hkv`` query and key-value heads, ``D`` head
dimension, ``L`` one sequence's length; ``T`` as in the package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollshard.train.config import VARLEN_ATTENTION as VARLEN


def sequence_lengths(position_ids: torch.Tensor) -> list[int]:  # [T] -> S lengths summing to T
    """Lengths of the packed sequences of one row: a sequence starts wherever the position does not
    advance by exactly 1 (``masking_utils.find_packed_sequence_indices``' rule)."""
    T = position_ids.numel()
    starts = torch.nonzero(position_ids[1:] - position_ids[:-1] != 1).flatten() + 1  # [S-1]
    cuts = [0, *starts.tolist(), T]
    return [b - a for a, b in zip(cuts[:-1], cuts[1:])]


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, Dv]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,  # [B, T] or [1, T]
    **kwargs,
) -> tuple[torch.Tensor, None]:  # [B, T, Hq, Dv]
    """transformers attention-function signature; causal attention within each packed sequence."""
    if attention_mask is not None:
        raise ValueError(f"{VARLEN} received an attention mask; it takes packed sequences without padding")
    if softcap is not None or s_aux is not None:
        raise ValueError(
            f"{VARLEN} has no attention-logit softcapping or attention sinks; use --attn-implementation eager"
        )
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError(f"{VARLEN} is causal self-attention only; use --attn-implementation sdpa")
    B, _, T, _ = query.shape
    if key.shape[2] != T:
        raise ValueError(f"{VARLEN} has no KV cache (query {T} tokens, keys {key.shape[2]}); generate with sdpa")
    if position_ids is None:
        raise ValueError(
            f"{VARLEN}: {type(module).__name__} does not pass position_ids to its attention function, so the "
            "packed sequences cannot be told apart; use --attn-implementation sdpa"
        )
    if position_ids.dim() != 2:
        raise ValueError(
            f"{VARLEN} takes position ids of shape [batch, tokens], got {tuple(position_ids.shape)} (multimodal "
            "rotary positions); use --attn-implementation sdpa"
        )
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for b in range(B):
        lengths = sequence_lengths(position_ids[b if position_ids.shape[0] > 1 else 0])  # [S]
        parts = []
        for q, k, v in zip(*(t[b : b + 1].split(lengths, dim=2) for t in (query, key, value))):  # [1, H, L, D]
            if sliding_window is not None and q.shape[2] > sliding_window:
                parts.append(banded_attention(q, k, v, sliding_window, dropout, scaling, gqa))
            else:
                parts.append(
                    F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
                )  # [1, Hq, L, Dv]
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    out = torch.cat(rows) if B > 1 else rows[0]  # [B, Hq, T, Dv]
    return out.transpose(1, 2).contiguous(), None


def banded_attention(q, k, v, window: int, dropout: float, scaling: float | None, gqa: bool) -> torch.Tensor:  # [1, Hq, L, Dv]
    """Causal attention within a sliding window (``masking_utils``: key ``j`` is seen by query ``i`` when
    ``i - window < j <= i``), in query tiles of ``window``: tile ``[s, e)`` attends to keys ``[s - window + 1, e)``
    through a ``[e - s, e - s + window - 1]`` band mask, so memory is ``O(window^2)``, not ``O(L^2)``."""
    if gqa and q.is_cuda:  # the fused kernels that take a mask do not take grouped heads: repeat them
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    L, out = q.shape[2], []
    for s in range(0, L, window):
        e, ks = min(s + window, L), max(0, s - window + 1)
        qi = torch.arange(s, e, device=q.device)[:, None]  # [e-s, 1] query positions
        kj = torch.arange(ks, e, device=q.device)[None, :]  # [1, e-ks] key positions
        band = (kj <= qi) & (kj > qi - window)  # [e-s, e-ks]
        out.append(
            F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e], attn_mask=band, dropout_p=dropout, scale=scaling,
                enable_gqa=gqa,
            )
        )
    return torch.cat(out, dim=2)


def no_dense_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> None:
    """The mask function of :data:`VARLEN` (``AttentionMaskInterface``): no mask at all, the boundaries come
    from the position ids; refuses a padding mask or a cache offset, which it could not honour."""
    if attention_mask is not None and not bool(attention_mask[:, -kv_length:].all()):
        raise ValueError(f"{VARLEN} takes packed sequences without padding; got an attention mask with padding")
    if q_length != kv_length or int(q_offset) != 0 or int(kv_offset) != 0:
        raise ValueError(f"{VARLEN} has no KV cache (query {q_length} tokens, keys {kv_length}); generate with sdpa")
    return None


def register() -> None:
    """Make ``attn_implementation="rollshard_varlen"`` loadable (idempotent; done on import)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, no_dense_mask)


register()

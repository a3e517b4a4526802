"""The megatron backend's per-sequence core attention (rollshard.train.backends.megatron.attention) against
megatron-core's own DotProductAttention given the dense block-diagonal causal mask of the packed sequences."""

from __future__ import annotations

import pytest
import torch

from rollshard.train.backends.distributed import DistEnv


@pytest.fixture()
def megatron_world():
    from rollshard.train.backends.megatron.parallel import close_parallel, init_parallel

    init_parallel(DistEnv(), tp=1, pp=1, ep=1)  # one process: a gloo world of one
    yield
    close_parallel()


def test_packed_attention_equals_megatron_attention_with_the_block_mask(megatron_world):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from rollshard.train.backends.megatron.attention import PackedSequenceAttention, packed_sequences
    from rollshard.train.backends.megatron.forward import packed_causal_mask

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                               attention_dropout=0.0, masked_softmax_fusion=False, use_cpu_initialization=True)
    attn = PackedSequenceAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                   attention_type="self")
    lengths = (5, 1, 0, 7, 3)  # five sequences, one of a single token, one empty
    position_ids = torch.cat([torch.arange(n) for n in lengths])  # [T] for the block mask
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # [S+1]
    T = position_ids.numel()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, 1, 4, 8, generator=g)  # [T, B, heads, d]
    k, v = torch.randn(T, 1, 2, 8, generator=g), torch.randn(T, 1, 2, 8, generator=g)  # [T, B, groups, d]

    dense = attn(q, k, v, packed_causal_mask(position_ids))  # megatron-core's kernel, [T, T] mask
    with packed_sequences(cu_seqlens):
        packed = attn(q, k, v, None)
    assert packed.shape == dense.shape == (T, 1, 32)
    assert (packed - dense).abs().max() <= 1e-6
    # The mask is what makes them equal: without it the sequences would see each other.
    assert (attn(q, k, v, torch.triu(torch.ones(T, T, dtype=torch.bool), 1)[None, None]) - packed).abs().max() > 1e-2


def test_block_mask_is_causal_within_sequences_only():
    from rollshard.train.backends.megatron.forward import packed_causal_mask

    mask = packed_causal_mask(torch.tensor([0, 1, 2, 0, 1]))[0, 0]  # True = masked
    allowed = (~mask).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]

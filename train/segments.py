"""Per-sequence reductions of packed tensors: ``[T]`` values of ``S`` sequences laid end to end, bounded by
``cu_seqlens [S+1]`` (the shape vocabulary of :mod:`rollshard.train.losses`)."""

from __future__ import annotations

import torch


def sequence_ids(cu_seqlens: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:  # [T]
    """Index of the sequence each packed token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [S]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:  # [S]
    """Per-sequence sum of a packed ``[T]`` tensor (differentiable)."""
    S = cu_seqlens.numel() - 1
    return torch.zeros(S, dtype=values.dtype, device=values.device).index_add(0, sequence_ids(cu_seqlens), values)


def segment_mean(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:  # [S]
    """Per-sequence mean of ``values`` over the tokens where ``mask`` is 1; 0 for a sequence with none."""
    return segment_sum(values * mask, cu_seqlens) / segment_sum(mask, cu_seqlens).clamp(min=1.0)

"""GRPO advantages by explicit group id (pure functions of tensors).

``A_i = (r_i - mean_g r) / (std_g r + eps)`` over the rows ``i`` of group ``g``
(Shao et al., 2024); with ``normalize_std=False`` the division is dropped (Dr. GRPO,
Liu et al., 2025). Groups are given by an index per sequence, never by the position
of a row in the batch, so groups of any (uneven) size are normalized correctly; this
is where slime falls back to one batch-wide group (slime issues #1414, #2230).

Decisions, documented here because peers differ; the group definitions are the store's
(:mod:`rollshard.store.format.groups`), so the loader's counts, ``--drop-zero-variance`` and these
advantages agree:

* ``std`` is the unbiased sample standard deviation (``ddof =``
  :data:`~rollshard.store.format.groups.REWARD_STD_DDOF` = 1, ``torch.std``), as verl and TRL.
* A group of one (single-member) has no baseline. ``single_member="reward"`` (default) follows verl:
  mean 0 and std 1, so the advantage is the reward itself; this keeps one-row groups
  such as a multi-agent selector trainable. ``"zero"`` gives them advantage 0.
* A group of two or more rows whose rewards are all equal (zero variance; a group of
  one is not one) gets advantage exactly 0,
  not ``(r - mean) / eps``: float rounding in the mean would otherwise be amplified
  by ``1 / eps`` into a spurious signal. Such groups are reported
  (:attr:`GroupAdvantages.zero_variance`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from rollshard.store.format.groups import REWARD_STD_DDOF

# Added to the group std before dividing (REFERENCE.md "Loss formulas": 1e-6); keeps a
# group with a tiny but nonzero spread from blowing its advantages up without bound.
ADV_EPS = 1e-6

SingleMember = Literal["reward", "zero"]


@dataclasses.dataclass(kw_only=True, frozen=True)
class GroupAdvantages:
    """Per-sequence advantages of one step and the group statistics behind them."""

    advantages: torch.Tensor  # [N] float32
    mean: torch.Tensor  # [G] group reward mean (0 for a single-member group under "reward")
    std: torch.Tensor  # [G] group reward std (1 for a single-member group under "reward")
    size: torch.Tensor  # [G] int64 rows per group
    zero_variance: torch.Tensor  # [G] bool: >= 2 rows, all rewards equal

    def metrics(self) -> dict[str, float]:
        a = self.advantages
        multi = self.size >= 2
        return {
            "adv/mean": a.mean().item(),
            "adv/std": a.std().item() if a.numel() > 1 else 0.0,
            "adv/min": a.min().item(),
            "adv/max": a.max().item(),
            "adv/frac_zero_var_groups": self.zero_variance.float().mean().item(),
            "adv/frac_single_groups": (~multi).float().mean().item(),
        }


def grpo_advantages(
    rewards: torch.Tensor,  # [N]
    group_index: torch.Tensor,  # [N] int64 in [0, G)
    *,
    num_groups: int | None = None,
    normalize_std: bool = True,
    eps: float = ADV_EPS,
    single_member: SingleMember = "reward",
) -> GroupAdvantages:
    """GRPO (or Dr. GRPO with ``normalize_std=False``) advantage of every sequence."""
    if rewards.shape != group_index.shape or rewards.ndim != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be equal 1-D")
    if single_member not in ("reward", "zero"):
        raise ValueError(f"single_member must be 'reward' or 'zero', got {single_member!r}")
    G = int(num_groups if num_groups is not None else (int(group_index.max()) + 1 if group_index.numel() else 0))
    r = rewards.double()  # [N] float64: the group sums must not round the mean
    idx = group_index.long()

    size = torch.bincount(idx, minlength=G)  # [G]
    if (size == 0).any():
        empty = torch.nonzero(size == 0).flatten()[:5].tolist()
        raise ValueError(f"groups {empty} have no rows; group_index must cover 0..{G - 1}")
    mean = torch.zeros(G, dtype=r.dtype).index_add_(0, idx, r) / size  # [G]
    dev = r - mean[idx]  # [N]
    sq = torch.zeros(G, dtype=r.dtype).index_add_(0, idx, dev * dev)  # [G]
    std = (sq / (size - REWARD_STD_DDOF).clamp(min=1)).sqrt()  # [G] unbiased
    r_max = torch.full((G,), -torch.inf, dtype=r.dtype).scatter_reduce(0, idx, r, "amax")
    r_min = torch.full((G,), torch.inf, dtype=r.dtype).scatter_reduce(0, idx, r, "amin")

    single = size == 1  # [G] store.groups.is_single_member
    zero_var = (~single) & (r_max == r_min)  # [G] store.groups.is_zero_variance: >= 2 rows, all equal
    if single_member == "reward":
        mean = torch.where(single, torch.zeros_like(mean), mean)
        std = torch.where(single, torch.ones_like(std), std)
    adv = r - mean[idx]  # [N]
    if normalize_std:
        adv = adv / (std[idx] + eps)
    silent = zero_var | (single if single_member == "zero" else torch.zeros_like(single))  # [G]
    adv = torch.where(silent[idx], torch.zeros_like(adv), adv)
    return GroupAdvantages(
        advantages=adv.float(), mean=mean.float(), std=std.float(), size=size, zero_variance=zero_var
    )


def token_advantages(
    seq_advantages: torch.Tensor,  # [S]
    cu_seqlens: torch.Tensor,  # [S+1]
    loss_mask: torch.Tensor,  # [T]
) -> torch.Tensor:  # [T]
    """Broadcast each sequence's advantage to its tokens; 0 where ``loss_mask`` is 0."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [S]
    if int(lengths.sum()) != loss_mask.numel():
        raise ValueError(f"cu_seqlens covers {int(lengths.sum())} tokens but loss_mask has {loss_mask.numel()}")
    per_token = torch.repeat_interleave(seq_advantages.float(), lengths)  # [T]
    return per_token * loss_mask.float()


def step_advantages(
    micro_batches: list,  # rollshard.store.loader PackedBatch: rewards [S], seq_group [S], cu_seqlens, loss_mask
    *,
    num_groups: int,
    normalize_std: bool = True,
    eps: float = ADV_EPS,
    single_member: SingleMember = "reward",
) -> tuple[GroupAdvantages, list[torch.Tensor]]:  # the step's groups, and each micro-batch's [T] advantages
    """GRPO advantages of a loader step's whole groups, and each micro-batch's per-token advantages."""
    rewards = torch.cat([mb.rewards for mb in micro_batches])  # [N]
    groups = torch.cat([mb.seq_group for mb in micro_batches])  # [N]
    out = grpo_advantages(rewards.cpu(), groups.cpu(), num_groups=num_groups, normalize_std=normalize_std, eps=eps,
                          single_member=single_member)
    per_mb = out.advantages.split([mb.num_sequences for mb in micro_batches])
    return out, [token_advantages(a, mb.cu_seqlens, mb.loss_mask) for a, mb in zip(per_mb, micro_batches)]

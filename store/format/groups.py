"""A GRPO group's reward statistics, declared once: the loader, ``stats``/``inspect``, the notebook and the
trainer's advantages all use these definitions.

* Reward spread is the unbiased sample standard deviation (:data:`REWARD_STD_DDOF` = 1),
  as the trainer normalizes advantages (``torch.std``, verl, TRL).
* A **single-member** group (one row, e.g. the multi-agent selector) has no baseline.
  The trainer's default (verl's) gives it mean 0 and std 1, so its advantage is its
  reward: it *is* trained, and it is not a zero-variance group.
* A **zero-variance** group has two or more rows whose rewards are all exactly equal:
  every advantage in it is 0, it carries no learning signal. ``--drop-zero-variance``
  drops these and only these.

Rewards here are the finite rewards of the group's rows (a failed row may have none).
"""

from __future__ import annotations

import numpy as np
import polars as pl

REWARD_STD_DDOF = 1  # unbiased: the std the trainer divides advantages by


def is_single_member(rewards: np.ndarray) -> bool:
    """One row: no baseline (see the module docstring)."""
    return len(rewards) == 1


def is_zero_variance(rewards: np.ndarray) -> bool:
    """Two or more rows, all rewards exactly equal: every GRPO advantage of the group is 0."""
    return len(rewards) >= 2 and bool(rewards.max() == rewards.min())


def group_flags(reward: pl.Expr = pl.col("reward")) -> list[pl.Expr]:
    """Aggregations for ``group_by("group_id").agg(...)``: ``single_member`` and ``zero_variance`` per group."""
    finite = reward.filter(reward.is_finite())
    return [
        (finite.len() == 1).alias("single_member"),
        ((finite.len() >= 2) & (finite.n_unique() == 1)).alias("zero_variance"),
    ]

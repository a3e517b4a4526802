"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay.

A pure function of the optimizer-update index, so a resumed run sets the exact rate
from the step counter alone (no scheduler state to save).
"""

from __future__ import annotations

import math


def lr_factor(update: int, *, warmup: int, total: int | None, decay: str, min_ratio: float) -> float:
    """Multiplier of the peak rate for the ``update``-th optimizer update (0-based)."""
    if warmup > 0 and update < warmup:
        return (update + 1) / warmup
    if decay == "constant":
        return 1.0
    if total is None:
        raise ValueError(f"lr decay {decay!r} needs the schedule length: pass --decay-steps or --max-steps")
    span = max(total - warmup, 1)
    progress = min(max(update - warmup, 0) / span, 1.0)
    if decay == "linear":
        shape = 1.0 - progress
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr decay {decay!r}; use constant, linear or cosine")
    return min_ratio + (1.0 - min_ratio) * shape

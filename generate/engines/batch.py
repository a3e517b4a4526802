"""The embedded engine's running batch: its requests, their KV cache, sampling state, next positions and tokens.

The scheduler (:mod:`.embedded`) builds a batch from each prefill (:meth:`Batch.prefilled`),
merges it into the running one, and drops finished rows (:meth:`Batch.select`); the
pieces live with what they hold: the cache in :mod:`.kv_cache`, the per-row sampling
parameters and random streams in :mod:`.sampler`.
"""

from __future__ import annotations

from typing import Any

import torch

from rollshard.generate.engines import kv_cache
from rollshard.generate.engines.kv_cache import KV
from rollshard.generate.engines.sampler import SamplingRows


class Batch:
    """Request rows (the scheduler's), their :class:`KV`, :class:`SamplingRows`, positions and last tokens."""

    def __init__(
        self,
        rows: list[Any] | None = None,
        kv: KV | None = None,
        sampling: SamplingRows | None = None,
        pos: torch.Tensor | None = None,  # [B] position id of the next input token
        last: torch.Tensor | None = None,  # [B] next input token
    ) -> None:
        self.rows = rows or []
        self.kv, self.sampling, self.pos, self.last = kv, sampling, pos, last

    def merge(self, new: "Batch", reserve_columns: int) -> "Batch":
        """These rows then ``new``'s (see :func:`.kv_cache.merge`)."""
        if not self.rows:
            return new
        return Batch(
            self.rows + new.rows,
            kv_cache.merge(self.kv, new.kv, reserve_columns),
            self.sampling.merge(new.sampling),
            torch.cat([self.pos, new.pos]),
            torch.cat([self.last, new.last]),
        )

    def select(self, keep: list[int]) -> "Batch":
        """The rows ``keep``, in that order."""
        if len(keep) == len(self.rows):
            return self
        if not keep:
            return Batch()
        index = torch.tensor(keep, dtype=torch.long, device=self.pos.device)
        return Batch(
            [self.rows[i] for i in keep],
            kv_cache.select(self.kv, index),
            self.sampling.select(keep, index),
            self.pos.index_select(0, index),
            self.last.index_select(0, index),
        )

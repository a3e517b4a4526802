"""The loader's settings, its output (:class:`Step`) and the names both use."""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import numpy as np

from rollshard.store.loader.packing import PackedBatch
from rollshard.store.format.schema import OPTIONAL_COLUMNS, STATUS_VALUES

STATE_FORMAT = "rollshard-loader"
MIXTURE_STATE_FORMAT = "rollshard-loader-mixture"  # store/loader/mixture.py
# 3: a block's groups in group_id order (read.py; a state of version 2 or 1 resumes in the file's order, the one
# its cursor counts in); 2: each rank's cursor in its own share of the blocks; 1: in the global stream every rank
# read (a version-1 state resumes a world size of 1 only, where the two are the same stream)
STATE_VERSION = 3
FILE_ORDER_STATE_VERSION = 2  # the newest version whose cursors count a block's groups in the file's order
SMALL_COLUMNS = ["sample_id", "group_id", "agent", "status", "reward", "weight_version", "temperature"]
SPAN_COLUMNS = ["weight_versions"]  # read with the small ones: each row's oldest version (filters.py)
TOKEN_COLUMNS = ["prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask"]
SAMPLING_COLUMNS = list(OPTIONAL_COLUMNS)  # schema 1.1, read with the token columns when a shard has them
NO_VERSION = np.iinfo(np.int64).min  # a row without weight_version: its staleness is unknown
POLL_S = 0.1  # how often a blocked background thread checks whether it was told to stop
JOIN_S = 10.0  # how long close() waits for a thread to finish the read it is in
OPEN_FILES = 16  # Parquet files a reader keeps open (shards are read block by block, in shuffled order)
SCAN_THREADS = 8  # shards scanned at once when the loader opens a dataset without row groups in its manifest
HASH_AHEAD_BLOCKS = 8  # shards of the next blocks queued for their checksum before the reader gets there
# Below this many blocks per rank, whole blocks would share the groups out too unevenly (and a rank might get
# none): every rank then reads every block and takes every world_size-th group of the one stream (plan.py).
MIN_BLOCKS_PER_RANK = 4
TAG_BLOCKS, TAG_WINDOW = 1, 2  # random streams: block order, window permutation

FILTER_KEYS = (
    "groups_examined",
    "rows_examined",
    "filtered_rows/status",
    "filtered_rows/agent",
    "filtered_rows/no_reward",
    "filtered_rows/stale",
    "filtered_rows/no_version",
    "filtered_groups/empty",
    "filtered_groups/zero_variance",
    "filtered_rows/zero_variance",
)
SOURCE_KEYS = ("groups", "sequences", "tokens", "loss_tokens")  # a mixture's per-source figures of a step (this rank)

# The agreement between ranks (steps.py): this rank's state -> the least state of any rank (the trainer's
# all-reduce with min). A rank whose loader raised says so before raising, so no rank waits for it.
SYNC_FAILED, SYNC_END, SYNC_STEP = 0, 1, 2  # raised / no step (its epoch ended) / has a step
Sync = Callable[[int], int]


class PeerFailedError(ValueError):
    """Another rank's loader raised (its own error is in its log); this one stops with it."""


class LoaderStateError(ValueError):
    """A loader state does not fit this loader (world size, rank, seed, dataset, order settings)."""


@dataclasses.dataclass(kw_only=True)
class LoaderConfig:
    """Settings of a :class:`RolloutLoader`; see the package docstring for what each one means."""

    groups_per_step: int = 8  # whole GRPO groups per optimizer step (per rank)
    micro_batch_tokens: int = 8192  # token budget of one packed micro-batch (prompt + response tokens)
    # Support-id budget of one micro-batch (schema 1.1 supports, PackedBatch.support_ids); None:
    # packing.SUPPORT_PER_TOKEN (64) x micro_batch_tokens, which never binds for top-k <= 64, so ordinary
    # top-k 20-50 data packs exactly as by tokens, and bounds a top-k 4096 micro-batch's ids at 1/64.
    micro_batch_support: int | None = None
    seed: int = 0
    shuffle: bool = True
    shuffle_window: int = 1024  # groups in the bounded shuffle window (of this rank's stream)
    statuses: tuple[str, ...] = ("completed", "truncated")
    agents: tuple[str, ...] | None = None  # None: every agent
    max_staleness: int | None = None  # needs current_version
    current_version: str | None = None
    drop_zero_variance: bool = False
    num_epochs: int | None = 1  # None: loop forever
    prefetch: int = 4  # blocks read ahead, and packed steps ready ahead
    tail: Literal["drop", "partial"] = "drop"  # a rank's last incomplete step of an epoch
    pin_memory: bool = False  # page-lock the packed tensors (when CUDA is available)
    # Checksums, exact column types and row invariants (package docstring). Off only to measure what they
    # cost: a damaged shard then reaches the trainer.
    verify_data: bool = True
    # Read the schema 1.2 routed_experts column (store/format/routing.py) where a shard has it: PackedBatch.routed_experts.
    routed_experts: bool = False

    def check(self) -> None:
        for name in ("groups_per_step", "micro_batch_tokens", "shuffle_window", "prefetch"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoaderConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.micro_batch_support is not None and self.micro_batch_support < 1:
            raise ValueError(
                f"LoaderConfig.micro_batch_support must be at least 1 or None (64 x micro_batch_tokens), "
                f"got {self.micro_batch_support}"
            )
        if self.seed < 0:
            raise ValueError(f"LoaderConfig.seed must be non-negative, got {self.seed}")
        bad = [s for s in self.statuses if s not in STATUS_VALUES]
        if bad or not self.statuses:
            raise ValueError(
                f"LoaderConfig.statuses {self.statuses!r}: choose one or more of {', '.join(STATUS_VALUES)}"
            )
        if self.agents is not None and not self.agents:
            raise ValueError("LoaderConfig.agents is empty; use None for every agent")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"LoaderConfig.max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"LoaderConfig.num_epochs must be >= 1 or None (forever), got {self.num_epochs}")
        if self.tail not in ("drop", "partial"):
            raise ValueError(f"LoaderConfig.tail must be 'drop' or 'partial', got {self.tail!r}")


@dataclasses.dataclass(kw_only=True)
class Step:
    """One optimizer step on one rank: whole groups, packed into micro-batches.

    ``metrics`` are this rank's: the filter counts (:data:`FILTER_KEYS`) of the groups this rank examined
    for the step, and its packing figures (``groups``, ``tokens``, ``packing_efficiency``, ...); summed over
    the ranks they are the global step's.
    """

    micro_batches: list[PackedBatch]
    group_ids: list[str]  # [G]; PackedBatch.seq_group indexes this
    epoch: int
    index: int  # step index, counted across epochs
    metrics: dict[str, float]  # filter counts and packing figures, this rank's
    group_sources: list[str] | None = None  # [G] source name of each group (a mixture, store/loader/mixture.py); else None

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.micro_batches)

    @property
    def num_sequences(self) -> int:
        return sum(b.num_sequences for b in self.micro_batches)

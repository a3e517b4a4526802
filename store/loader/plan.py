"""The plan of an epoch: the block order, this rank's share of it, its windows, and the cursor.

**Order.** The blocks are put in an order drawn from ``(seed, epoch)`` (the file order without
``shuffle``), the same on every rank. **Share.** They are then dealt to the ranks in that order, each
block to the rank with the least weight so far (tokens: blocks.py; ties to the lowest rank), so the
ranks' shares are disjoint, together the whole dataset, and balanced to within one block; each rank
reads only its own blocks. With fewer than ``MIN_BLOCKS_PER_RANK`` blocks per rank (a small dataset)
whole blocks would share the groups out too unevenly, so the ranks instead *share* one stream, that of
a world size of 1: every rank reads every block (as small as the dataset is) and rank ``r`` takes the
stream's groups ``r, r + w, r + 2w, ...`` (so the first step of each of ``w`` ranks together are the
first step of one rank with ``w`` times the groups, when no filter drops one). A rank's share as a list
of pieces (block, first group, groups) is its stream; a world size of 1, or a shared stream, is the
block order itself.

**Windows.** A rank's stream is cut into consecutive windows of ``shuffle_window`` groups, each
permuted by ``(seed, epoch, window)``. Memory: one window of groups.

**Steps per epoch.** Every rank knows every rank's share, so it knows the most steps any epoch can
give every rank (``step_cap``: the smallest share in groups, over ``groups_per_step``, rounded down
for ``tail="drop"``, up for ``"partial"``); no rank takes more, so without filters that drop groups
the ranks take the same number of steps with no communication. Filters can leave a rank fewer: the
loader's ``sync`` (loader.py) then ends the epoch on every rank at once.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from rollshard.store.loader.blocks import _Block
from rollshard.store.loader.config import _TAG_BLOCKS, _TAG_WINDOW, MIN_BLOCKS_PER_RANK, LoaderConfig, Step

if TYPE_CHECKING:
    from rollshard.store.loader.filters import _Segment


def _random_keys(n: int, *words: int) -> np.ndarray:
    """``n`` random 64-bit keys from a bit generator whose stream numpy keeps stable across versions."""
    return np.random.PCG64(np.random.SeedSequence(list(words))).random_raw(n)


def shared(num_blocks: int, world_size: int) -> bool:
    """Whether the ranks share one global stream (too few blocks to deal them out)."""
    return world_size > 1 and num_blocks < MIN_BLOCKS_PER_RANK * world_size


def _residues(n: int, r: int, w: int) -> int:
    """How many of 0..n-1 are r modulo w."""
    return max(0, (n - r + w - 1) // w)


def deal(weights: np.ndarray, world_size: int) -> np.ndarray:
    """[n] the rank of each of ``n`` blocks, in order: each to the rank with the least weight so far (ties: the
    lowest rank)."""
    owner = np.zeros(len(weights), np.int64)
    load = [0] * world_size
    for i, w in enumerate(weights.tolist()):
        r = load.index(min(load))
        owner[i] = r
        load[r] += w
    return owner


class _EpochPlan:
    """Block order, this rank's pieces of it and their window permutations, for one epoch."""

    def __init__(self, blocks: list[_Block], cfg: LoaderConfig, epoch: int, rank: int = 0, world_size: int = 1):
        self.cfg, self.epoch = cfg, epoch
        n, w = len(blocks), world_size
        keys = _random_keys(n, cfg.seed, epoch, _TAG_BLOCKS)
        self.order = np.argsort(keys, kind="stable") if cfg.shuffle else np.arange(n)  # every rank's, [n]
        sizes = np.array([blocks[b].num_groups for b in self.order], np.int64)  # [n]
        self.shared = shared(n, w)
        if w == 1:
            self.piece_block, self.piece_start, self.piece_groups = self.order, np.zeros(n, np.int64), sizes
            shares = sizes.sum(keepdims=True)
        elif n >= MIN_BLOCKS_PER_RANK * w:
            owner = deal(np.array([blocks[b].weight for b in self.order], np.int64), w)
            mine = owner == rank
            self.piece_block, self.piece_groups = self.order[mine], sizes[mine]
            self.piece_start = np.zeros(len(self.piece_block), np.int64)
            shares = np.bincount(owner, weights=sizes, minlength=w).astype(np.int64)
        else:  # shared: every rank reads every block; rank r takes the stream's groups r, r + w, r + 2w, ...
            self.piece_block, self.piece_start, self.piece_groups = self.order, np.zeros(n, np.int64), sizes
            shares = np.array([_residues(int(sizes.sum()), r, w) for r in range(w)], np.int64)
        self.shares = shares  # [world size] groups of each rank's share
        self.cum = np.zeros(len(self.piece_block) + 1, np.int64)  # cum[i]: groups in the pieces before piece i
        np.cumsum(self.piece_groups, out=self.cum[1:])
        self.num_groups = int(self.cum[-1])  # this rank's
        self.window = cfg.shuffle_window
        self.num_windows = -(-self.num_groups // self.window)
        least, g = int(shares.min()), cfg.groups_per_step
        self.step_cap = least // g if cfg.tail == "drop" else -(-least // g)
        self.rank, self.world_size = rank, w

    def mine(self, position: int) -> bool:
        """Whether the group at stream position ``position`` is this rank's (every one, unless shared)."""
        return not self.shared or position % self.world_size == self.rank

    def left(self, position: int) -> int:
        """This rank's groups of the epoch at stream positions ``position`` and after."""
        if not self.shared:
            return self.num_groups - position
        r, w = self.rank, self.world_size
        return _residues(self.num_groups, r, w) - _residues(position, r, w)

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.window, min((k + 1) * self.window, self.num_groups)

    def first_block(self, position: int) -> int:
        """Index (in this rank's pieces) of the piece holding stream position ``position``'s window start."""
        start = (position // self.window) * self.window
        if start >= self.num_groups:
            return len(self.piece_block)
        return int(np.searchsorted(self.cum, start, side="right") - 1)

    def permutation(self, k: int) -> np.ndarray:
        lo, hi = self.bounds(k)
        if not self.cfg.shuffle:
            return np.arange(hi - lo)
        return np.argsort(_random_keys(hi - lo, self.cfg.seed, self.epoch, _TAG_WINDOW, k), kind="stable")


@dataclasses.dataclass(frozen=True)
class _Cursor:
    epoch: int = 0
    position: int = 0  # raw groups of this rank's epoch stream already examined
    step: int = 0  # index of the next step


@dataclasses.dataclass(frozen=True)
class _EpochEnd:
    """Marks the end of an epoch in :meth:`_Stream.groups`."""

    epoch: int
    num_groups: int  # raw groups of this rank's epoch stream


@dataclasses.dataclass
class _Item:
    """What the producer hands over: a step (or an epoch end, or new counts), the cursor after it, its validity.

    ``end``: the item ends this rank's epoch (the mixture: the run). ``cut``: for a step, the epoch end to take
    instead when another rank has no step (its cursor and counts: the step's groups and the rest of the epoch
    counted as left over, nothing delivered).
    """

    step: Step | None
    cursor: _Cursor
    epoch_counts: dict[str, int]
    segment: "_Segment"
    end: bool = False
    cut: "_Item | None" = None
    counts_after: dict[str, int] | None = None  # the counts the cursor carries on (None: ``epoch_counts``)

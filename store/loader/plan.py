"""The plan of an epoch: the block order, each rank's share of it, its windows, and the cursor.

**Order.** The blocks are put in an order drawn from ``(seed, epoch)`` (the file order without
``shuffle``), the same on every rank. **Share** (:func:`share_out`). Every rank computes every rank's
share from the order alone, so the shares are disjoint and together the whole dataset (each group once)
with no communication. The blocks are dealt whole, in that order, each to the rank with the least weight
so far (tokens: blocks.py; ties to the lowest rank), up to the last few: the *remainder*, the fewest last
blocks whose groups can bring every rank up to the *target*, the groups every rank can be given
(``tail="drop"``: the most whole steps every rank can have, ``groups // (world size x groups_per_step) x
groups_per_step``; ``"partial"``: ``groups // world size``). The remainder's groups then go, in order, as
one slice to each rank below the target (what it lacks: a piece (block, first group, groups) that may
share its block with the next rank's slice), the rest of the block the slicing ends in to the rank that
sliced it last, and the blocks after that whole again, dealt on by weight. So every rank has at least the
target, and an epoch uses every group but the tail: under ``world size x groups_per_step`` groups
(``"drop"``), under ``world size`` (``"partial"``), plus what the filters drop.

**Reads.** A rank reads each block of its share once (a sliced block whole). With ``B`` blocks of equal
weight and ``R`` remainder blocks, a rank reads at most ``1/W + (1 + R)/B`` of the dataset (``W``: the
world size): the greedy deal leaves it within one block of ``1/W`` of the dealt blocks, and the remainder
adds at most its ``R`` blocks. ``R`` is small: the dealt blocks are balanced by tokens, so their group
counts differ by about a block, and the remainder only has to make that up (the bench's 78 blocks: ``R`` =
1 at a world size of 8; store/loader/__init__.py gives the figures). With fewer than
``MIN_BLOCKS_PER_RANK`` blocks per rank (a small dataset) whole blocks would share the groups out too
unevenly, so the ranks instead *share* one stream, that of a world size of 1: every rank reads every
block that holds one of its groups (as small as the dataset is) and rank ``r`` takes the stream's
groups ``r, r + w, r + 2w, ...`` (so the first step of each of ``w`` ranks together are the first step
of one rank with ``w`` times the groups, when no filter drops one). A rank's share as a list of pieces
is its stream; a world size of 1, or a shared stream, is the block order itself.

**Windows.** A rank's stream is cut into consecutive windows of ``shuffle_window`` groups, each
permuted by ``(seed, epoch, window)``. Memory: one window of groups. The blocks of a window are read in
the order its permutation first needs them (:meth:`EpochPlan.read_order`), so a step waits for the
blocks of its own groups, not for the whole window, and a run that stops within a window (a mixture
whose other source ran out, a resume mid-window) reads only the blocks of the groups it takes, plus the
reader's ``prefetch``.

**Steps per epoch.** Every rank knows every rank's share, so it knows the most steps any epoch can
give every rank (``step_cap``: the smallest share in groups, over ``groups_per_step``, rounded down
for ``tail="drop"``, up for ``"partial"``, which the target makes every share's); no rank takes more,
so without filters that drop groups the ranks take the same number of steps with no communication.
Filters can leave a rank fewer: the loader's ``sync`` (loader.py) then ends the epoch on every rank at
once.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from rollshard.store.loader.blocks import Block
from rollshard.store.loader.config import MIN_BLOCKS_PER_RANK, TAG_BLOCKS, TAG_WINDOW, LoaderConfig, Step

if TYPE_CHECKING:
    from rollshard.store.loader.filters import Segment


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


def share_out(weights: np.ndarray, sizes: np.ndarray, world_size: int, target: int) -> tuple[list, np.ndarray, int]:
    """Every rank's pieces of the block order: ``(pieces, shares, remainder blocks)``.

    ``pieces``: [world size] lists of (position in the order, first group, groups); ``shares``: [world size] groups
    of each. The blocks are dealt whole (:func:`deal`, by ``weights``) up to the most blocks ``k`` such that the
    groups of the blocks after them (the remainder) can bring every rank up to ``target`` groups. The remainder
    then goes, in order, as one slice of groups to each rank below ``target`` (what it lacks), the rest of the
    block that slicing ended in to the rank that took its last slice (which reads that block anyway), and the
    blocks left after that whole, dealt on by ``weights`` (a sliced block counts whole: a rank reads it all).
    """
    w = world_size
    owner = deal(weights, w)
    dealt = np.bincount(owner, weights=sizes, minlength=w).astype(np.int64)
    k, rest = len(owner), 0
    while k > 0 and int(np.maximum(target - dealt, 0).sum()) > rest:
        k -= 1
        dealt[owner[k]] -= sizes[k]
        rest += int(sizes[k])
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(w)]
    for j in range(k):
        pieces[int(owner[j])].append((j, 0, int(sizes[j])))
    load = np.bincount(owner[:k], weights=weights[:k], minlength=w).astype(np.int64)
    shares = dealt.copy()
    j, used, last = k, 0, None  # j: the remainder block being sliced, used: its groups already given
    for r in range(w):
        need = max(0, target - int(shares[r]))
        while need > 0:
            take = min(need, int(sizes[j]) - used)
            pieces[r].append((j, used, take))
            if used == 0:
                load[r] += weights[j]
            shares[r] += take
            need, used, last = need - take, used + take, r
            if used == sizes[j]:
                j, used = j + 1, 0
    if used:  # the rest of the block the slicing ended in: the same piece, grown
        _, first, _ = pieces[last].pop()
        pieces[last].append((j, first, int(sizes[j]) - first))
        shares[last] += int(sizes[j]) - used
        j += 1
    for j in range(j, len(owner)):  # whole again
        r = int(np.argmin(load))
        pieces[r].append((j, 0, int(sizes[j])))
        load[r] += weights[j]
        shares[r] += int(sizes[j])
    return pieces, shares, len(owner) - k


class EpochPlan:
    """Block order, this rank's pieces of it and their window permutations, for one epoch."""

    def __init__(self, blocks: list[Block], cfg: LoaderConfig, epoch: int, rank: int = 0, world_size: int = 1):
        self.cfg, self.epoch = cfg, epoch
        n, w = len(blocks), world_size
        keys = _random_keys(n, cfg.seed, epoch, TAG_BLOCKS)
        self.order = np.argsort(keys, kind="stable") if cfg.shuffle else np.arange(n)  # every rank's, [n]
        sizes = np.array([blocks[b].num_groups for b in self.order], np.int64)  # [n]
        self.shared = shared(n, w)
        self.remainder_blocks = 0  # blocks whose groups are sliced among the ranks (module docstring)
        if w == 1:
            self.piece_block, self.piece_start, self.piece_groups = self.order, np.zeros(n, np.int64), sizes
            shares = sizes.sum(keepdims=True)
        elif n >= MIN_BLOCKS_PER_RANK * w:
            weights = np.array([blocks[b].weight for b in self.order], np.int64)
            total, g = int(sizes.sum()), cfg.groups_per_step
            target = total // (w * g) * g if cfg.tail == "drop" else total // w  # what every rank can be given
            pieces, shares, self.remainder_blocks = share_out(weights, sizes, w, target)
            at, start, count = (np.array(c, np.int64).reshape(-1) for c in zip(*pieces[rank])) if pieces[rank] else \
                (np.zeros(0, np.int64),) * 3
            self.piece_block, self.piece_start, self.piece_groups = self.order[at], start, count
        else:  # shared: each rank reads the blocks of its groups (about all); rank r takes groups r, r + w, r + 2w, ...
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

    def left(self, position: int) -> int:
        """This rank's groups of the epoch at stream positions ``position`` and after."""
        if not self.shared:
            return self.num_groups - position
        r, w = self.rank, self.world_size
        return _residues(self.num_groups, r, w) - _residues(position, r, w)

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.window, min((k + 1) * self.window, self.num_groups)

    def draws(self, k: int, start: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Window ``k``'s groups from stream position ``start`` on, in the order they are taken, this rank's only
        (all of them unless shared: then the slots ``p`` with ``(lo + p) % world_size == rank``): each one's slot
        ``p`` in the window (the cursor's position after it is ``lo + p + 1``), its stream position ``lo +
        permutation[p]`` and the piece holding that."""
        lo, hi = self.bounds(k)
        p = np.arange(max(start, lo) - lo, hi - lo)  # [n]
        if self.shared:
            p = p[(lo + p) % self.world_size == self.rank]
        position = lo + self.permutation(k)[p]
        return p, position, np.searchsorted(self.cum, position, side="right") - 1

    def read_order(self, k: int, start: int = 0) -> list[int]:
        """The pieces window ``k``'s groups from position ``start`` on draw from, in the order they are first
        needed: a step waits only for the blocks its own groups are in, not for the whole window."""
        _, _, pieces = self.draws(k, start)
        _, first = np.unique(pieces, return_index=True)
        return pieces[np.sort(first)].tolist()

    def permutation(self, k: int) -> np.ndarray:
        lo, hi = self.bounds(k)
        if not self.cfg.shuffle:
            return np.arange(hi - lo)
        return np.argsort(_random_keys(hi - lo, self.cfg.seed, self.epoch, TAG_WINDOW, k), kind="stable")


@dataclasses.dataclass(frozen=True)
class Cursor:
    epoch: int = 0
    position: int = 0  # raw groups of this rank's epoch stream already examined
    step: int = 0  # index of the next step


@dataclasses.dataclass(frozen=True)
class EpochEnd:
    """Marks the end of an epoch in :meth:`GroupStream.groups`."""

    epoch: int
    num_groups: int  # raw groups of this rank's epoch stream


@dataclasses.dataclass
class ProducerItem:
    """What the producer hands over: a step (or an epoch end, or new counts), the cursor after it, its validity.

    ``end``: the item ends this rank's epoch (the mixture: the run). ``cut``: for a step, the epoch end to take
    instead when another rank has no step (its cursor and counts: the step's groups and the rest of the epoch
    counted as left over, nothing delivered).
    """

    step: Step | None
    cursor: Cursor
    epoch_counts: dict[str, int]
    segment: "Segment"
    end: bool = False
    cut: "ProducerItem | None" = None
    counts_after: dict[str, int] | None = None  # the counts the cursor carries on (None: ``epoch_counts``)

"""The stream: this rank's blocks read in plan order, their groups filtered and cut into steps.

:meth:`GroupStream.read_blocks` runs on the reader thread (``prefetch`` blocks ahead), :meth:`GroupStream.items`
on the producer thread (``prefetch`` packed steps ahead); both are deterministic functions of the
cursor, so a restart (a resume, a version change, an epoch ended by another rank) re-plans exactly.

**Steps.** A rank's stream is cut into steps of ``groups_per_step`` groups that pass the filters; a
group never spans steps or epochs. An epoch ends on a rank when its share runs out, or when it has taken
the epoch's ``step_cap`` (plan.py), the most steps every rank's share allows (the shares are brought to
one target, so what the cap leaves is the tail only). ``tail="drop"`` (the
default) drops a last incomplete step (its groups counted as ``tail_dropped_groups``); ``tail="partial"``
yields it as a smaller last step. The groups of the share not examined when the epoch ends (at the cap,
or ended by another rank through the loader's ``sync``) are counted as ``left_groups``. Nothing is ever
duplicated: over the ranks, ``groups_examined + left_groups`` is the dataset's group count each epoch.

**Damaged data never reaches a step.** A step is planned from blocks as they arrive but handed on only
once every block it draws from is verified (store/io/integrity.py :class:`Checksums`, on a third thread), so
a shard whose bytes changed can cost a planned step, never a delivered one. When the manifest records the
byte ranges (manifest version 3) the reader reads each block's row groups as one ranged read, queues the
hash of exactly those bytes (XXH3-128 from manifest version 4 on, else sha256), and decodes the block from
them (:func:`block_reader`), so verifying costs no read beyond the block's own bytes; each shard's footer is checked once
per loader, queued ``HASH_AHEAD_BLOCKS`` blocks before the reader reaches the shard. A rank thus verifies
only the blocks it reads (every read of them), and the ranks together every byte each epoch. A shard
whose entry lacks the ranges (an older manifest) is hashed whole, once per loader, as before.
"""

from __future__ import annotations

import collections
import mmap
import sys
import threading
import warnings
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.common import DataError, one_line
from rollshard.store.io.integrity import CheckThread, Checksums, Job, verify_ranges
from rollshard.store.loader.assemble import make_step
from rollshard.store.loader.background import END, Background, Stopped
from rollshard.store.loader.blocks import Block, open_dataset_shard
from rollshard.store.loader.config import HASH_AHEAD_BLOCKS, OPEN_FILES, SMALL_COLUMNS, LoaderConfig
from rollshard.store.loader.filters import Filters, Segment, VersionBox
from rollshard.store.loader.plan import Cursor, EpochEnd, EpochPlan, ProducerItem
from rollshard.store.loader.protocol import NoStepError, NoStepWarning
from rollshard.store.loader.read import BlockData, read_block


class GroupStream:
    """This rank's group stream and steps, as a deterministic function of the cursor."""

    def __init__(
        self,
        dataset: RolloutDataset,
        blocks: list[Block],
        cfg: LoaderConfig,
        rank: int,
        world_size: int,
        checks: CheckThread | None = None,
    ):
        self.dataset, self.blocks, self.cfg = dataset, blocks, cfg
        self.rank, self.world_size = rank, world_size
        self.filters = Filters.of(cfg)
        self._plans: dict[int, EpochPlan] = {}
        thread = checks or CheckThread(f"rollshard-checksum-{rank}")
        self.checksums = Checksums(dataset.storage, dataset.shards, thread, by_range=True, footers=dataset.footer)
        self.num_groups = sum(b.num_groups for b in blocks)  # the whole dataset's, every rank's shares together
        self._read_lock = threading.Lock()
        self.read_stats = collections.Counter()  # blocks and compressed bytes this rank read (counted as read)
        self.file_order = False  # True: groups in the file's order (a version-2 state resumed: config.py)

    def plan(self, epoch: int) -> EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:  # two threads may both build it; plans are pure, so either copy is right
            plan = self._plans[epoch] = EpochPlan(self.blocks, self.cfg, epoch, self.rank, self.world_size)
            for old in [e for e in list(self._plans) if e < epoch - 1]:  # a copy: the other thread may insert
                self._plans.pop(old, None)
        return plan

    def step_cap(self, epoch: int) -> float:
        """The most steps this rank takes in ``epoch`` (no cap at a world size of 1)."""
        return self.plan(epoch).step_cap if self.world_size > 1 else float("inf")

    # -- reading ------------------------------------------------------------------------------

    def read_blocks(
        self, start: Cursor, preloaded: dict, stop: threading.Event
    ) -> Iterator[tuple[tuple[int, int], BlockData]]:
        """This rank's pieces from ``start`` on, epoch after epoch, keyed (epoch, piece): each window's in the order
        its groups first need them (:meth:`EpochPlan.read_order`), each piece once, none that only groups before
        ``start`` need."""
        files: collections.OrderedDict[int, tuple[Any, pq.ParquetFile]] = collections.OrderedDict()
        epoch, position = start.epoch, start.position
        try:
            while (self.cfg.num_epochs is None or epoch < self.cfg.num_epochs) and not stop.is_set():
                plan, done = self.plan(epoch), set()
                for k in range(position // plan.window, plan.num_windows):
                    order = [i for i in plan.read_order(k, position) if i not in done]
                    done.update(order)
                    for n, i in enumerate(order):
                        if stop.is_set():
                            return
                        if self.cfg.verify_data:  # hashing runs ahead of the reading, so that a step rarely waits
                            for j in order[n : n + HASH_AHEAD_BLOCKS]:
                                self.checksums.touch(self.blocks[plan.piece_block[j]].shard)
                        data = preloaded.pop((epoch, i), None)
                        if data is None:
                            data = self._read(files, self.blocks[plan.piece_block[i]], stop)
                            if data is None:
                                return
                        yield (epoch, i), data
                epoch, position = epoch + 1, 0
        finally:
            for f, _ in files.values():
                f.close()

    def _read(self, files: collections.OrderedDict, block: Block, stop: threading.Event) -> BlockData | None:
        """One block, checked; None when told to stop while waiting for a checksum."""
        info = self.dataset.shards[block.shard]
        shard = info.path
        verify = self.cfg.verify_data  # read_blocks queued this shard's checksum already
        jobs: list[Job] = []
        try:
            f, pf = self._file(files, block.shard)
            if verify and info.has_ranges:  # the block's bytes, read once: hashed as they are decoded
                rgs = [info.row_groups[r] for r in block.row_groups]
                offset, end = rgs[0].offset, rgs[-1].offset + rgs[-1].length
                try:
                    held, raw = block_reader(f, info.bytes, offset, end, pf.metadata, block.row_groups)
                except OSError as e:
                    raise DataError(f"{shard}: cannot read row groups {list(block.row_groups)}: {one_line(e)}") from e
                jobs.append(self.checksums.submit(Job(shard, _RangeCheck(info, block.row_groups, offset, raw))))
                pf = pq.ParquetFile(held, metadata=pf.metadata)
            data = read_block(pf, block, self.filters, shard, check=verify, sort=not self.file_order)
            if len(data.group_ids) != block.num_groups:
                raise DataError(
                    f"{shard}: row groups {list(block.row_groups)} hold {len(data.group_ids)} groups, "
                    f"{block.num_groups} when the loader opened the dataset; a committed shard must not change "
                    "(open a new loader)"
                )
        except DataError:
            # Damaged bytes show up as unreadable pages or absurd values; the checksum names the cause.
            if verify and not (self.checksums.wait(block.shard, stop)
                               and all(self.checksums.wait_job(j, stop) for j in jobs)):
                return None
            raise
        data.shard = block.shard
        data.checks = jobs
        self._count_read(block, data)
        return data

    def _count_read(self, block: Block, data: BlockData) -> None:
        footer = self.dataset.footer(block.shard)
        names = None if data.tokens is not None else set(SMALL_COLUMNS)  # None: every column read counts
        size = 0
        for r in block.row_groups:
            rg = footer.row_group(r)
            for c in range(rg.num_columns):
                col = rg.column(c)
                if names is None or col.path_in_schema in names:
                    size += col.total_compressed_size
        with self._read_lock:
            self.read_stats.update(blocks=1, row_groups=len(block.row_groups), bytes=size)

    def wait_verified(self, pending: list[tuple[BlockData, int, np.ndarray]], stop: threading.Event) -> None:
        """Wait until every shard and block ``pending`` draws from is verified (raises the DataError of one that is
        not): the shard's footer (or whole file, without ranges), then the block's bytes."""
        if not self.cfg.verify_data:
            return
        blocks = list({id(bd): bd for bd, _, _ in pending}.values())
        for shard in sorted({bd.shard for bd in blocks}):
            if not self.checksums.wait(shard, stop):
                raise Stopped
        for bd in blocks:
            for job in bd.checks:
                if not self.checksums.wait_job(job, stop):
                    raise Stopped

    def _file(self, files: collections.OrderedDict, shard: int) -> tuple[Any, pq.ParquetFile]:
        if shard in files:
            files.move_to_end(shard)
        else:
            files[shard] = open_dataset_shard(self.dataset, shard)
            if len(files) > OPEN_FILES:
                files.popitem(last=False)[1][0].close()
        return files[shard]

    def reader(self, start: Cursor, preloaded: dict) -> Background:
        """The block reader thread from the start of ``start``'s window on (``preloaded``: blocks in memory)."""
        return Background(
            lambda s: self.read_blocks(start, preloaded, s), self.cfg.prefetch, f"rollshard-loader-read-{self.rank}"
        )

    # -- groups and steps ---------------------------------------------------------------------

    def groups(
        self, start: Cursor, reader: Background, held: dict, stop: threading.Event
    ) -> Iterator[tuple[int, int, BlockData, int] | EpochEnd]:
        """This rank's raw group stream from ``start`` on (before any filter), epoch after epoch.

        Yields ``(epoch, position after the group, block, index of the group in the block)`` for each group,
        and an :class:`EpochEnd` after each epoch's last. ``held`` holds the current window's blocks (read
        through ``reader``); it is emptied when the epoch after an EpochEnd is asked for.
        """
        epoch, position = start.epoch, start.position
        while self.cfg.num_epochs is None or epoch < self.cfg.num_epochs:
            plan = self.plan(epoch)
            for k in range(position // plan.window, plan.num_windows):
                lo, hi = plan.bounds(k)
                first = int(np.searchsorted(plan.cum, lo, side="right") - 1)  # the window's first piece
                for key in [key for key in held if key < (epoch, first)]:  # earlier windows' only
                    del held[key]
                for p, q, i in zip(*(a.tolist() for a in plan.draws(k, position))):
                    if (epoch, i) not in held:  # the reader reads the pieces in the order they are first needed
                        self._pull(reader, held, epoch, i, first, stop)
                    yield epoch, lo + p + 1, held[(epoch, i)], int(plan.piece_start[i]) + q - int(plan.cum[i])
            yield EpochEnd(epoch=epoch, num_groups=plan.num_groups)
            epoch, position = epoch + 1, 0
            held.clear()

    def items(
        self,
        start: Cursor,
        counts: dict[str, int],
        preloaded: dict,
        held: dict,
        version: VersionBox,
        stop: threading.Event,
    ) -> Iterator[ProducerItem]:
        """Steps and epoch ends from ``start`` on: :meth:`groups` filtered and cut into this rank's steps.

        ``preloaded``: blocks already in memory, by (epoch, piece); ``held`` receives the blocks of the
        current window, so that a restart (a version change) need not read them again.
        """
        while start is not None:
            reader = self.reader(start, preloaded)
            gen = self.groups(start, reader, held, stop)
            try:
                start = yield from self._epochs(start, counts, gen, version, stop)
            finally:
                gen.close()
                reader.close()
            counts, preloaded = {}, {}
            held.clear()

    def _epochs(self, start: Cursor, counts, gen, version: VersionBox, stop) -> Iterator[ProducerItem]:
        """The items of :meth:`items` until an epoch ends at its step cap; returns the cursor to go on from then
        (None: the stream is done)."""
        cfg = self.cfg
        step = start.step
        epoch_counts = collections.Counter(counts)
        pending: list[tuple[BlockData, int, np.ndarray]] = []
        seg = Segment(version.current.threshold, self.filters)
        for g in gen:
            if isinstance(g, EpochEnd):
                if pending and cfg.tail == "partial":
                    self.wait_verified(pending, stop)
                    epoch_counts.update(seg.counts)
                    epoch_counts["steps"] += 1
                    after = Cursor(g.epoch, g.num_groups, step + 1)
                    yield self._item(pending, seg, after, g.epoch, step, epoch_counts, left=0)
                    step += 1
                    pending, seg = [], Segment(seg.threshold, self.filters)
                epoch_counts.update(seg.counts)
                epoch_counts["tail_dropped_groups"] += len(pending)
                if epoch_counts["steps"] == 0:
                    self._no_step(g.epoch, epoch_counts)
                yield self._end(epoch_counts, Cursor(g.epoch + 1, 0, step), seg)
                epoch_counts = collections.Counter()
                pending, seg = [], Segment(version.current.threshold, self.filters)
                continue
            epoch, after_position, bd, j = g
            if epoch_counts["steps"] >= self.step_cap(epoch):  # resumed at the cap, or a cap of 0
                epoch_counts["left_groups"] += self.plan(epoch).left(after_position - 1)
                if epoch_counts["steps"] == 0:
                    self._no_step(epoch, epoch_counts)
                yield self._end(epoch_counts, Cursor(epoch + 1, 0, step), seg)
                return Cursor(epoch + 1, 0, step)
            kept = seg.examine(bd, j)
            if kept is not None:
                pending.append((bd, j, kept))
            if len(pending) == cfg.groups_per_step:
                self.wait_verified(pending, stop)
                epoch_counts.update(seg.counts)
                epoch_counts["steps"] += 1
                left = self.plan(epoch).left(after_position)
                after = Cursor(epoch, after_position, step + 1)
                yield self._item(pending, seg, after, epoch, step, epoch_counts, left)
                step += 1
                pending, seg = [], Segment(version.current.threshold, self.filters)
                if left and epoch_counts["steps"] >= self.step_cap(epoch):  # every rank's share allows no more
                    epoch_counts["left_groups"] += left
                    yield self._end(epoch_counts, Cursor(epoch + 1, 0, step), seg)
                    return Cursor(epoch + 1, 0, step)
        return None

    @staticmethod
    def _end(epoch_counts: collections.Counter, after: Cursor, seg: Segment) -> ProducerItem:
        """The end of this rank's epoch: its counts for ``epoch_stats``; the next epoch starts from nothing."""
        epoch_counts.update(tail_dropped_groups=0, left_groups=0)  # present, 0 or not
        return ProducerItem(step=None, cursor=after, epoch_counts=dict(epoch_counts), segment=seg, end=True, counts_after={})

    @staticmethod
    def _pull(reader: Background, held: dict, epoch: int, piece: int, first: int, stop: threading.Event) -> None:
        """Read until ``held`` holds ``piece`` of ``epoch``, keeping what arrives from the window's ``first`` piece
        on (a restart's reader may bring pieces of the window's groups already taken)."""
        while (epoch, piece) not in held:
            item = reader.get(stop)
            if item is END:
                raise RuntimeError(f"block reader ended before block {piece} of epoch {epoch}")
            key, data = item
            if key >= (epoch, first):
                held[key] = data

    def _no_step(self, epoch: int, counts: collections.Counter) -> None:
        kept = counts["groups_examined"] - counts["filtered_groups/empty"] - counts["filtered_groups/zero_variance"]
        share = f" of this rank's share (rank {self.rank} of {self.world_size})" if self.world_size > 1 else ""
        msg = (
            f"epoch {epoch} yields no step: {kept} of {counts['groups_examined']} groups{share} pass the filters, a "
            f"step needs {self.cfg.groups_per_step} (groups_per_step); loosen the filters, lower groups_per_step, "
            "or set tail='partial'"
        )
        if self.cfg.num_epochs is None:
            raise NoStepError(msg)  # repeating it forever would loop without a step
        warnings.warn(msg, NoStepWarning, stacklevel=2)

    def _item(self, pending, seg: Segment, cursor: Cursor, epoch: int, index: int, epoch_counts, left: int) -> ProducerItem:
        step = make_step(pending, seg.counts, epoch=epoch, index=index, cfg=self.cfg)
        cut_counts = collections.Counter(epoch_counts)  # another rank has no step: this one ends its epoch instead
        cut_counts.update(steps=-1, tail_dropped_groups=len(pending), left_groups=left)
        cut = self._end(cut_counts, Cursor(epoch + 1, 0, index), seg)
        return ProducerItem(step=step, cursor=cursor, epoch_counts=dict(epoch_counts), segment=seg, cut=cut)


class _RangeCheck:
    """A block's bytes against the manifest's hashes of its row groups, XXH3-128 or sha256 (a :class:`Job`'s run)."""

    def __init__(self, info, row_groups: tuple[int, ...], offset: int, data: bytes):
        self.info, self.row_groups, self.offset, self.data = info, row_groups, offset, data

    def __call__(self, stop: threading.Event) -> bool:
        verify_ranges(self.info, self.row_groups, self.offset, self.data)
        return True


# Bytes after a block's end that a decode may touch: Arrow pads a column chunk's read by up to 100 bytes for files
# of old parquet-mr writers (its kMaxDictHeaderSize); rollshard's shards never need it.
HELD_SLACK = 4096


def block_reader(f, size: int, offset: int, end: int, footer: pq.FileMetaData | None = None,
          row_groups: tuple[int, ...] = ()) -> tuple[pa.BufferReader, memoryview]:
    """A shard as Parquet sees it when only one block's bytes are in memory (the footer comes parsed), and those
    bytes ``[offset, end)``, read straight from ``f`` (natively: a Python file object would be called from Arrow's
    threads, which can then hang the interpreter's exit) with one copy, so the block is decoded from exactly the
    bytes that are hashed.

    When ``footer`` places every column chunk of ``row_groups`` inside ``[offset, end)`` (a shard of rollshard's
    writer: the manifest's ranges are the footer's), the bytes go into a buffer of Arrow's memory pool, which keeps
    freed pages for the next block, and Parquet reads the shard through a view of it that starts ``offset`` bytes
    before it: every read lands inside (measured 5x faster than filling a fresh mapping, whose every page
    faults in). Otherwise (an unexpected layout): an anonymous mapping of the shard's size (pages never written take
    no memory), where a read elsewhere sees zeros: a decode error, which waits for the checksums to name the
    cause."""
    if footer is not None and row_groups and chunks_within(footer, row_groups, offset, end):
        buf = pa.allocate_buffer(end - offset + HELD_SLACK)
        view = memoryview(buf)[: end - offset]
        _read_into(f, view, offset)
        return pa.BufferReader(pa.foreign_buffer(buf.address - offset, size, base=buf)), view
    # MAP_NORESERVE (0x4000 on Linux; no constant in Python 3.11): the size is not charged to the commit limit
    # (strict overcommit, ulimit -v), since only the block's pages are ever written.
    noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
    mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | noreserve)
    view = memoryview(mm)[offset:end]
    _read_into(f, view, offset)
    return pa.BufferReader(pa.py_buffer(mm)), view


def _read_into(f, view: memoryview, offset: int) -> None:
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"the file ends at byte {offset + done}, before the block's end at byte {offset + len(view)}")
        done += n


def chunks_within(footer: pq.FileMetaData, row_groups: tuple[int, ...], offset: int, end: int) -> bool:
    """Whether every column chunk of ``row_groups`` lies in ``[offset, end)`` by the footer."""
    for r in row_groups:
        if not 0 <= r < footer.num_row_groups:
            return False
        rg = footer.row_group(r)
        for c in range(rg.num_columns):
            col = rg.column(c)
            first = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
            if first is None or first < offset or first + col.total_compressed_size > end:
                return False
    return True

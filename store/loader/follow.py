"""Following a live dataset: steps from shards as their commits land (``rollshard-train --follow``).

A generator keeps committing shards into the dataset while the trainer trains on it: the dataset is the
queue between them. :class:`FollowLoader` takes the shards in commit order (the manifests' ``created_at``,
then the path), each one whole as soon as a manifest lists it, never before: a shard is part of the
dataset only once committed (store/format/manifest.py), and no group spans two shards. Each shard's bytes are
checked against its manifest's sha256 and its rows against the schema's invariants before any row of it
reaches a step; the filters and the packing are the streaming loader's (filters.py, assemble.py), so a step
here is the step :class:`~rollshard.store.loader.RolloutLoader` would build from the same groups.

Order: groups in the order they were committed (oldest first, no shuffle): a follower trains on what is
newest only once the older rows are used, so the staleness of what it trains stays bounded by how far
the generator runs ahead (the generator's admission gate, ``rollshard-generate --max-ahead``), and the
staleness filter drops the rest from each row's oldest token version (filters.py).

Waiting: while fewer committed groups than a step are left, the loader polls the manifests every
``poll_s`` seconds (local or S3: the same :class:`~rollshard.store.io.storage.Storage`); after ``wait_s``
seconds without a new commit it raises :class:`FollowTimeoutError`. It ends when the dataset is complete
(every writer left its end-of-run marker, store/io/live.py) and every committed group is used; the last
groups short of a step are dropped (``tail="drop"``, counted in ``epoch_stats``) or trained (``"partial"``).
:meth:`stop_waiting` (the trainer's signal handler) ends a wait at the next poll.

Resume is exact: the state holds the shards used up and the next group of the shard in use after the last step
taken; the groups a step took are never taken again and none after it is skipped (a shard committed meanwhile is
simply next), and the groups read for a step that a stop cut short are read again.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.common import DataError
from rollshard.store.io.live import is_complete
from rollshard.store.loader.assemble import make_step
from rollshard.store.loader.blocks import Block
from rollshard.store.loader.config import LoaderConfig, LoaderStateError, Step
from rollshard.store.loader.filters import Filters, Segment, parse_version
from rollshard.store.loader.protocol import StepLoader
from rollshard.store.loader.read import BlockData, read_block
from rollshard.store.format.manifest import ShardInfo, load_manifests
from rollshard.store.io.storage import Storage

FOLLOW_STATE_FORMAT = "rollshard-loader-follow"
FOLLOW_STATE_VERSION = 1
POLL_S = 0.05  # seconds between two reads of the manifests while waiting for a commit (JSON files: cheap)
WAIT_S = 600.0  # seconds without a new commit before the follower gives up


class FollowTimeoutError(ValueError):
    """No shard was committed for ``wait_s`` seconds while the follower needed one."""


class FollowLoader(StepLoader):
    """Iterable of :class:`Step` over a dataset being written: whole groups in commit order, packed.

    One process (``world_size`` 1). ``num_epochs`` and ``shuffle`` of the config do not apply: each
    committed group is used once, in commit order. ``max_steps`` is the caller's (the trainer's).
    """

    def __init__(
        self,
        path: str | os.PathLike | Storage,
        config: LoaderConfig | None = None,
        *,
        poll_s: float = POLL_S,
        wait_s: float = WAIT_S,
        rank: int = 0,
        world_size: int = 1,
    ):
        if world_size != 1:
            raise ValueError("following a live dataset runs in one process: drop --nproc-per-node (world size 1)")
        if not (poll_s > 0 and wait_s > 0):
            raise ValueError(f"poll_s and wait_s must be > 0, got {poll_s} and {wait_s}")
        self.config = config = config or LoaderConfig()
        config.check()
        self.rank, self.world_size = 0, 1
        self.storage = path if isinstance(path, Storage) else Storage(path)
        self.poll_s, self.wait_s = poll_s, wait_s
        self._filters = Filters.of(config)
        self._used: list[str] = []  # shards every group of which was taken (examined), in the order taken
        self._partial: str | None = None  # the shard in use (some of its groups taken)
        self._next_group = 0  # its next group
        self._mark = (0, None, 0)  # (shards used up, shard in use, its next group) after the last step taken
        self._steps = 0
        self._threshold: int | None = None
        self._version_text: str | None = None
        self._stop = False
        self._epoch_stats: dict[str, float] = {}
        self.polls = 0  # reads of the manifests that found nothing new (each followed by a wait of poll_s)
        self._dataset: RolloutDataset | None = None  # the last snapshot read
        if config.current_version is not None:
            self.set_current_version(config.current_version)

    # -- the loader's interface ---------------------------------------------------------------

    @property
    def datasets(self) -> list[RolloutDataset]:
        """The dataset as last read (its manifests; the shards committed so far)."""
        return [self._snapshot() if self._dataset is None else self._dataset]

    def set_current_version(self, version: str | int) -> None:
        threshold = None
        if self.config.max_staleness is not None:
            threshold = parse_version(version, "current_version") - self.config.max_staleness
        self._version_text, self._threshold = str(version), threshold

    @property
    def current_version(self) -> str | None:
        return self._version_text

    @property
    def epoch_stats(self) -> dict[str, float]:
        """The counts of the run so far (its one pass has no epochs)."""
        return self._epoch_stats

    def stop_waiting(self) -> None:
        """End a wait for commits at its next poll (safe from a signal handler): the iteration then ends."""
        self._stop = True

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The cursor after the last step taken (groups read for a step not taken are read again on resume)."""
        used, partial, next_group = self._mark
        return {
            "format": FOLLOW_STATE_FORMAT,
            "version": FOLLOW_STATE_VERSION,
            "dataset": self.storage.uri,
            "groups_per_step": self.config.groups_per_step,
            "used_shards": self._used[:used],
            "shard_in_use": partial,
            "next_group": next_group,
            "steps": self._steps,
            "current_version": self._version_text,
        }

    def load_state_dict(self, state: dict | list[dict]) -> None:
        if isinstance(state, list):
            state = state[0]
        if not isinstance(state, dict) or state.get("format") != FOLLOW_STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise LoaderStateError(
                f"the checkpoint's loader state is {found!r}, not a follower's: resume it without --follow"
            )
        if state.get("version") != FOLLOW_STATE_VERSION:
            raise LoaderStateError(f"follower state version {state.get('version')!r}; this rollshard reads 1")
        self._used = list(state["used_shards"])
        self._partial = state["shard_in_use"]
        self._next_group = int(state["next_group"])
        self._steps = int(state["steps"])
        self._set_mark()
        if state.get("current_version") is not None:
            self.set_current_version(state["current_version"])

    def __iter__(self) -> Iterator[Step]:
        cfg = self.config
        if cfg.max_staleness is not None and self._threshold is None:
            raise ValueError("max_staleness needs the policy version: set LoaderConfig.current_version")
        self._stop = False
        used, self._partial, self._next_group = self._mark  # from the last step taken
        del self._used[used:]
        pending: list[tuple[BlockData, int, np.ndarray]] = []
        segment = Segment(self._threshold, self._filters)
        waited = 0.0
        for info, bd, waited_for in self._shards():
            waited += waited_for
            first = self._next_group if info.path == self._partial else 0
            for j in range(first, len(bd.group_ids)):
                rows = segment.examine(bd, j)
                if j + 1 == len(bd.group_ids):  # the cursor after group j
                    self._used.append(info.path)
                    self._partial, self._next_group = None, 0
                else:
                    self._partial, self._next_group = info.path, j + 1
                if rows is not None:
                    pending.append((bd, j, rows))
                if len(pending) == cfg.groups_per_step:
                    self._set_mark()
                    yield self._step(pending, segment, waited)
                    pending, waited = [], 0.0
                    segment = Segment(self._threshold, self._filters)  # the version may have moved
        if self._stop:  # a stop while waiting: the groups read for the next step stay for a resume
            return
        self._set_mark()  # the end: the last groups are trained (tail "partial") or dropped, and counted
        counts = {k: float(v) for k, v in segment.counts.items()}
        if pending and cfg.tail == "partial":
            yield self._step(pending, segment, waited)
            counts = {}
        elif pending:
            counts["tail_dropped_groups"] = float(len(pending))
        self._epoch_stats = counts

    # -- internals ----------------------------------------------------------------------------

    def _set_mark(self) -> None:
        """The cursor as it stands is that of a step taken (what :meth:`state_dict` reports)."""
        self._mark = (len(self._used), self._partial, self._next_group)

    def _step(self, pending, segment: Segment, waited: float) -> Step:
        step = make_step(pending, segment.counts, epoch=0, index=self._steps, cfg=self.config)
        step.metrics["follow_wait_s"] = waited
        self._steps += 1
        return step

    def _snapshot(self) -> RolloutDataset:
        """The dataset as its manifests list it now (JSON only: no shard is opened here)."""
        self._dataset = RolloutDataset(self.storage, load_manifests(self.storage))
        return self._dataset

    def _shards(self) -> Iterator[tuple[ShardInfo, BlockData, float]]:
        """The shards not used up, read and checked, each with the seconds waited for its commit: the one in
        use first, then in commit order; the iteration ends when the dataset is complete (or at a stop)."""
        taken = set(self._used)
        while True:
            started = last_new = time.monotonic()
            while True:
                todo = [s for s in self._snapshot().shards if s.path not in taken]
                if todo:
                    break
                if self._stop or is_complete(self.storage):
                    return
                if time.monotonic() - last_new > self.wait_s:
                    raise FollowTimeoutError(
                        f"{self.storage.uri}: no new commit for {self.wait_s:.0f} s while following it; is its "
                        "generator running? (raise the wait with --follow-wait S)"
                    )
                self.polls += 1
                time.sleep(self.poll_s)
            info = min(todo, key=lambda s: (s.path != self._partial, s.created_at, s.path))
            taken.add(info.path)
            yield info, self._read(info), time.monotonic() - started

    def _read(self, info: ShardInfo) -> BlockData:
        """The shard's bytes checked against its manifest, its rows against the invariants, as one block."""
        data = self.storage.read_bytes(info.path)
        if self.config.verify_data and hashlib.sha256(data).hexdigest() != info.sha256:
            raise DataError(
                f"{info.path}: its bytes do not match the manifest's sha256 (damaged or rewritten after its "
                "commit); the follower stops before any row of it reaches a step"
            )
        try:
            pf = pq.ParquetFile(pa.BufferReader(data))
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{info.path}: not readable: {' '.join(str(e).split())}") from e
        block = Block(shard=0, row_groups=tuple(range(pf.metadata.num_row_groups)), num_groups=info.groups)
        return read_block(pf, block, self._filters, info.path, check=self.config.verify_data, sort=False)

"""The loaders: iteration from the cursor on a producer thread, the agreement between ranks, exact resume.

:class:`PrefetchingLoader` is what :class:`RolloutLoader` (one dataset) and store/loader/mixture.py's
``MixtureLoader`` share: the producer thread, the cursor, the policy version, and the ``sync``
agreement callback, called on the iterating thread (the trainer's) once for every step a rank is
about to yield and once for every end of its epoch, so the same number of times on every rank.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Iterator

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.io.integrity import CheckThread
from rollshard.store.loader.background import END, Background
from rollshard.store.loader.blocks import scan_blocks
from rollshard.store.loader.config import (
    MIXTURE_STATE_FORMAT,
    STATE_FORMAT,
    FILE_ORDER_STATE_VERSION,
    STATE_VERSION,
    LoaderConfig,
    SYNC_END,
    SYNC_FAILED,
    SYNC_STEP,
    LoaderStateError,
    PeerFailedError,
    Step,
    Sync,
)
from rollshard.store.loader.filters import PolicyVersion, VersionBox, parse_version
from rollshard.store.loader.plan import Cursor, ProducerItem
from rollshard.store.loader.protocol import StepLoader
from rollshard.store.loader.stream import GroupStream


class PrefetchingLoader(StepLoader):
    """What every loader of steps shares: the producer thread, iteration from the cursor, the policy version.

    A subclass sets ``config``, ``rank``, ``world_size``, ``_cursor``, ``_epoch_counts`` and implements
    :meth:`_produce` (a function of the stop event that yields :class:`ProducerItem`, holding no reference to the
    loader), :meth:`state_dict`, :meth:`load_state_dict` and :meth:`_close_streams`.
    """

    config: LoaderConfig
    rank: int
    world_size: int

    def _set_placement(
        self, config: LoaderConfig | None, rank: int, world_size: int, sync: Sync | None = None
    ) -> LoaderConfig:
        """Check and keep the config (default: :class:`LoaderConfig`), rank, world size and agreement callback;
        returns the config."""
        self.config = config = config or LoaderConfig()
        config.check()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if sync is not None and not callable(sync):
            raise ValueError(f"sync must be a function of this rank's state (an int: SYNC_*) or None, got {sync!r}")
        self.rank, self.world_size, self._sync = rank, world_size, sync
        return config

    def _init_common(self) -> None:
        self._version = VersionBox()
        if self.config.current_version is not None:
            self.set_current_version(self.config.current_version)
        self._epoch_stats: dict[str, float] = {}  # counts of the last finished epoch (incl. tail_dropped_groups)
        self._producer: Background | None = None
        self._held: dict = {}  # the producer's current window of blocks (reused by a restart)

    # -- public API ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Step]:
        self._check_ready()
        self._stop_producer()
        return self._steps(self._start_producer())  # prefetching starts now, not at the first next()

    def set_current_version(self, version: str | int) -> None:
        """The trainer's policy version; steps planned from now on filter staleness against it."""
        threshold = None
        if self.config.max_staleness is not None:
            threshold = parse_version(version, "current_version") - self.config.max_staleness
        self._version.current = PolicyVersion(str(version), threshold)  # one assignment: read unlocked by the producer

    @property
    def current_version(self) -> str | None:
        return self._version.current.text

    @property
    def epoch_stats(self) -> dict[str, float]:
        return self._epoch_stats

    def close(self) -> None:
        """Stop the background threads (iteration can start again later from the cursor)."""
        self._stop_producer()
        self._held = {}
        self._close_streams()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_producer", None) is not None:
            self._producer.close()
        self._close_streams()

    # -- internals ----------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self.config.max_staleness is not None and self._version.current.threshold is None:
            raise ValueError(
                "max_staleness needs the policy version: set LoaderConfig.current_version or call set_current_version()"
            )

    def _close_streams(self) -> None:
        raise NotImplementedError

    def _produce(self) -> Callable[[threading.Event], Iterator[ProducerItem]]:
        raise NotImplementedError

    def _start_producer(self) -> Background:
        self._producer = Background(self._produce(), self.config.prefetch, f"rollshard-loader-steps-{self.rank}")
        return self._producer

    def _stop_producer(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None

    def _steps(self, producer: Background) -> Iterator[Step]:
        self._agreement_done = False  # the agreement itself failed or answered "a rank failed": say nothing more
        try:
            while True:
                if self._producer is not producer:
                    raise RuntimeError("this loader iterator was replaced by a newer iter() or load_state_dict()")
                item = producer.get()
                if item is END:
                    return
                if not item.segment.holds_for(self._version.current.threshold):
                    # the policy version moved past a staleness decision of this prefetched step: re-plan it
                    producer.close()
                    producer = self._start_producer()
                    continue
                if (item.step is not None or item.end) and not self._agree(item.step is not None):
                    if item.step is not None:  # another rank has no step: the epoch ends here on every rank
                        self._take(item.cut)
                        producer.close()
                        self._held = {}
                        producer = self._start_producer()
                        continue
                self._take(item)
                if item.step is not None:
                    yield item.step
        except Exception:
            if self._sync is not None and not self._agreement_done:  # the others wait in the agreement: release them
                self._agreement_done = True
                self._sync(SYNC_FAILED)
            raise
        finally:
            if self._producer is producer:
                self._stop_producer()
                self._held = {}

    def _agree(self, has_step: bool) -> bool:
        """Whether every rank has a step (the trainer's ``sync``); without one, this rank's own answer. Raises
        :class:`PeerFailedError` when another rank's loader raised."""
        if self._sync is None:
            return has_step
        mine = SYNC_STEP if has_step else SYNC_END
        try:
            least = int(self._sync(mine))
        except BaseException:
            self._agreement_done = True
            raise
        if least == SYNC_FAILED:
            self._agreement_done = True
            raise PeerFailedError(
                f"rank {self.rank}: another rank's loader failed (its error is in its log); stopping with it"
            )
        if least > mine or least not in (SYNC_END, SYNC_STEP):
            self._agreement_done = True
            raise RuntimeError(
                f"the loader's sync callback answered {least} to state {mine}: it must return the least state of "
                f"every rank ({SYNC_FAILED} failed, {SYNC_END} no step, {SYNC_STEP} a step; an all-reduce with min)"
            )
        return least == SYNC_STEP

    def _take(self, item: ProducerItem) -> None:
        """Move the cursor past ``item``; an epoch end also becomes ``epoch_stats``."""
        self._cursor = item.cursor
        self._epoch_counts = item.epoch_counts if item.counts_after is None else dict(item.counts_after)
        if item.step is None:
            self._epoch_stats = {k: float(v) for k, v in item.epoch_counts.items()}


def own_state(state: Any, rank: int, world_size: int) -> Any:
    """This rank's state out of the list of every rank's (a state that is not a list is returned as it is)."""
    if not isinstance(state, list):
        return state
    if len(state) != world_size:
        raise LoaderStateError(
            f"loader state holds {len(state)} ranks' states, this loader world_size={world_size}: the data-parallel "
            "split depends on it; resume with the world size of the checkpoint"
        )
    return state[rank]


def check_state_header(state: Any, expected: str) -> None:
    """Raise :class:`LoaderStateError` unless ``state`` is a loader state of format ``expected`` that this rollshard
    reads."""
    if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, MIXTURE_STATE_FORMAT):
        raise LoaderStateError("not a rollshard loader state (no 'format': 'rollshard-loader')")
    if state["format"] != expected:
        if expected == STATE_FORMAT:
            names = ", ".join(s.get("name", "?") for s in state.get("sources") or [])
            raise LoaderStateError(
                f"loader state is of a mixture of sources {names}, this loader reads one dataset: the source list "
                "changed; resume with the --data of the checkpoint"
            )
        raise LoaderStateError(
            f"loader state is of one dataset (dataset={state.get('dataset')!r}), this loader mixes several sources: "
            "the source list changed; resume with the --data of the checkpoint"
        )
    if not isinstance(state.get("version"), int):
        raise LoaderStateError(f"loader state has no integer 'version' (format {expected!r})")
    if state["version"] > STATE_VERSION:  # 1 reads: world size 1 (check_state_settings)
        raise LoaderStateError(
            f"loader state version {state['version']} is newer than this rollshard's {STATE_VERSION}; upgrade rollshard"
        )


def check_state_settings(state: dict, mine: dict) -> None:
    """Raise :class:`LoaderStateError` naming the first setting the order depends on that differs."""
    if state["version"] < 2 and mine["world_size"] > 1:
        raise LoaderStateError(
            f"loader state version {state['version']} is of a rollshard where every rank read the whole stream; this "
            "one reads each rank's share, and cannot resume it at a world size above 1; start the data anew"
        )
    why = {
        "world_size": "the data-parallel split depends on it; resume with the world size of the checkpoint",
        "rank": "each rank reads its own share of the blocks: load each rank's own state_dict (keep every rank's "
        "in the checkpoint)",
        "seed": "the order depends on it; resume with the seed of the checkpoint",
        "dataset": "its shards were added, removed or rewritten since the checkpoint; resume on the same shards "
        "or start a new run",
        "shuffle": "the order depends on it",
    }
    if mine["shuffle"]:
        why["shuffle_window"] = "the order depends on it"
    if mine["world_size"] > 1:  # the ranks' shares are brought to a target of whole steps (plan.py)
        why["groups_per_step"] = why["tail"] = ("each rank's share of the blocks depends on it at a world size above 1; "
                                                "resume with the setting of the checkpoint")
    for key, reason in why.items():
        if key == "rank" and mine["world_size"] == 1:
            continue  # a world size of 1 is rank 0
        if key in mine and state.get(key) != mine[key]:
            raise LoaderStateError(
                f"loader state has {key}={state.get(key)!r}, this loader {key}={mine[key]!r}: {reason}"
            )


class RolloutLoader(PrefetchingLoader):
    """Iterable of :class:`Step`: whole GRPO groups of one rank's share, packed; see the package docstring.

    Iterating continues from the cursor (a new ``iter()`` picks up where the last step
    taken left off); with ``num_epochs=E`` the loader stops after E epochs in all.
    Each rank's cursor is its own (a position in its share): a checkpoint keeps every
    rank's state, and :meth:`load_state_dict` takes this rank's (or the list of all).
    ``sync``: the agreement callback (package docstring), called on the iterating thread.
    Call :meth:`close` (or use ``with``) to stop the threads early.
    """

    def __init__(
        self,
        dataset: RolloutDataset | str | os.PathLike,
        config: LoaderConfig | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        sync: Sync | None = None,
    ):
        config = self._set_placement(config, rank, world_size, sync)
        self.dataset = dataset if isinstance(dataset, RolloutDataset) else RolloutDataset.open(dataset)
        self._stream = open_stream(self.dataset, config, rank, world_size)
        self._num_groups = self._stream.num_groups
        self._cursor = Cursor()
        self._epoch_counts: dict[str, int] = {}
        self._init_common()

    @property
    def datasets(self) -> list[RolloutDataset]:
        return [self.dataset]

    @property
    def num_groups(self) -> int:
        return self._num_groups

    def state_dict(self) -> dict:
        """The cursor after the last step taken, and what it is valid for (JSON-serializable)."""
        c = self._cursor
        return {
            "format": STATE_FORMAT,
            "version": FILE_ORDER_STATE_VERSION if self._stream.file_order else STATE_VERSION,  # its cursor's order
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.config.seed,
            "dataset": self.dataset.fingerprint,
            "shuffle": self.config.shuffle,
            "shuffle_window": self.config.shuffle_window,
            "groups_per_step": self.config.groups_per_step,  # the shares' target depends on these two (plan.py)
            "tail": self.config.tail,
            "epoch": c.epoch,
            "cursor": {"position": c.position, "step": c.step},
            "current_version": self._version.current.text,
            "epoch_counts": dict(self._epoch_counts),
        }

    @property
    def read_stats(self) -> dict[str, int]:
        """Blocks, row groups and compressed bytes of Parquet columns this rank has read so far."""
        return dict(self._stream.read_stats)

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Resume at the step after the one the state was taken at; raises :class:`LoaderStateError` on a mismatch.

        ``state``: this rank's ``state_dict()``, or the list of every rank's (in rank order)."""
        state = own_state(state, self.rank, self.world_size)
        check_state_header(state, STATE_FORMAT)
        check_state_settings(state, self.state_dict())
        self._stop_producer()
        if state["version"] <= FILE_ORDER_STATE_VERSION:  # its cursor counts groups in the file's order
            self._stream.file_order, self._held = True, {}
        self._cursor = Cursor(state["epoch"], state["cursor"]["position"], state["cursor"]["step"])
        self._epoch_counts = dict(state.get("epoch_counts") or {})
        if state.get("current_version") is not None:
            self.set_current_version(state["current_version"])

    # -- internals ----------------------------------------------------------------------------

    def _check_ready(self) -> None:
        super()._check_ready()
        if self.config.num_epochs is None and self.num_groups == 0:
            raise ValueError(f"{self.dataset.storage.uri}: the dataset has no groups to loop over")

    def _close_streams(self) -> None:
        if getattr(self, "_stream", None) is not None:
            self._stream.checksums.close()

    def _produce(self) -> Callable[[threading.Event], Iterator[ProducerItem]]:
        # the thread holds the stream and a view of the version, never the loader, so an abandoned loader is freed
        stream, start, counts, version = self._stream, self._cursor, dict(self._epoch_counts), self._version
        preloaded, held = dict(self._held), {}  # copied here: a producer that outlived close() cannot touch it
        self._held = held
        return lambda stop: stream.items(start, counts, preloaded, held, version, stop)


def open_stream(
    dataset: RolloutDataset, config: LoaderConfig, rank: int, world_size: int, checks: CheckThread | None = None
) -> GroupStream:
    """The group stream of one dataset (its blocks scanned and checked); the machinery a mixture draws from.
    ``checks``: the checksum thread to hash on (a mixture's sources share one), else its own."""
    blocks = scan_blocks(dataset, check_types=config.verify_data)
    return GroupStream(dataset, blocks, config, rank, world_size, checks=checks)


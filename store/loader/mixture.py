"""Training from several datasets at once: a deterministic weighted mixture of group streams.

``--data a:0.7,b:0.3`` (:func:`parse_sources`): comma-separated sources, each
``[name=]path[:weight]``. The weight is the text after the *last* ``:`` when it parses
as a number (so ``s3://bucket/x:0.3`` is the path ``s3://bucket/x`` with weight 0.3, and
``s3://bucket/x`` has none); a number that is not positive and finite, or a trailing
``:`` with nothing after it, is an error. Either every source has a weight or none has
(then all weigh the same); weights need not sum to 1, they are normalized. The name of
a source (its metrics are ``source/<name>/...``) is the text before a leading ``=``
when that text is a plain name (a letter or digit, then letters, digits, ``_ . -``), else
the last component of its path (other characters as ``_``), made unique with ``-2``,
``-3``... in order. A path with a ``:NUMBER`` or ``NAME=`` of its own needs both parts
spelt out (``run:2:1``, ``d=date=2024/x``); a path may not hold a comma. One source,
weighted or not, is today's :class:`RolloutLoader` exactly (same order, same state);
:func:`open_loader` picks.

**Allocation.** Every source keeps its own group stream, this rank's stream of that dataset
as store/loader reads it (its own block order, share, windows and filters, drawn from the
same seed): each rank reads only its share of every source. A rank's step of
``groups_per_step`` group *slots* is filled slot by slot; slot ``s`` (counted on this rank
from the start of the run, across steps) goes to the next group that passes the filters in
the stream of source

    argmax_i  W_i * (s + 1) - T * taken_i       (ties: the first listed source)

where ``W_i`` are the weights as exact integers (the normalized weights as fractions over
their common denominator), ``T = sum(W_i)`` and ``taken_i`` the slots source ``i`` had
before ``s`` (stride scheduling). The rule depends on nothing but the slot index and the
weights: every rank applies the same allocation to its own slots, after any ``s`` slots
``taken_i`` is within 1 of ``s * W_i / T``, and the schedule repeats every ``T`` slots
(0.7/0.3 gives ``a b a a a b a a b a``: 7 and 3 in every 10), on every rank and so in every
global step. A group keeps the filters' counts of its own source; a step's filter counts
are summed over the sources (this rank's, as for one dataset).

**End of data** (first exhausted, as HF ``interleave_datasets``' default): each source
runs ``num_epochs`` epochs of its own stream, which crosses its epoch boundaries without
cutting a step; the mixture ends at the first slot whose source has no group left. The
step then being filled is the tail: ``tail="drop"`` drops it (``tail_dropped_groups``),
``tail="partial"`` yields it. The groups other sources still hold are never delivered.
Ranks' shares run out at different steps: with the loader's ``sync`` callback (store/loader)
the mixture ends on every rank at the first step some rank cannot fill (a rank that had
that step drops it, counted as ``tail_dropped_groups``); without one, each rank runs until its
own first source runs out. With ``num_epochs=None`` the mixture never ends; a source whose
whole epoch passes no group is then an error.

**Exact resume.** The state (``format: rollshard-loader-mixture``) holds the step index,
whether the mixture ended, and per source its name, path, weight (exact fraction), the
dataset fingerprint and its cursor: epoch, raw position in that epoch, slots taken and
groups kept in the epoch, all of this rank (a checkpoint keeps every rank's; the list of them
loads too). Loading a state whose sources (names, in order), weights or datasets differ, or
whose world size, rank, seed or shuffle settings differ, raises
:class:`LoaderStateError` naming what changed; so does loading a one-dataset state into
a mixture and the other way round.

**Metrics.** Each :class:`Step` carries ``group_sources`` (``[G]``, the source of each
group) and, for every source, ``source/<name>/groups``, ``/sequences``, ``/tokens``,
``/loss_tokens`` and ``source/<name>/epoch`` (this rank's, like every figure of a step);
``Step.epoch`` is the first source's epoch. ``epoch_stats`` (taken, as for one
dataset, when the step after the one in which a source finished an epoch is asked for, and at the end)
holds the counts of the whole run so far, the mixture having no epochs of its own: the
filter counts, ``steps`` and ``tail_dropped_groups``, each also per source as
``source/<name>/<key>``, ``source/<name>/groups`` delivered, ``source/<name>/epochs``
finished and ``source/<name>/exhausted`` (1 for the source that ended the mixture).

**Threads and memory**: per source, a reader thread (the sources' blocks decode side by side), one shuffle window and
``prefetch`` blocks read ahead; one checksum thread hashes every source's blocks, one producer packs the steps.

**Damaged data** stops the mixture as it stops one dataset's loader (store/loader), the one-line
:class:`DataError` prefixed with the source, ``source NAME (PATH): ``: its shard paths are relative to its dataset.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import re
import threading
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from rollshard.store.common import DataError
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.io.integrity import CheckThread
from rollshard.store.loader.assemble import make_step
from rollshard.store.loader.config import (
    FILTER_KEYS,
    MIXTURE_STATE_FORMAT,
    FILE_ORDER_STATE_VERSION,
    STATE_VERSION,
    LoaderConfig,
    LoaderStateError,
    Step,
    Sync,
)
from rollshard.store.loader.filters import Segment, VersionBox
from rollshard.store.loader.plan import Cursor, EpochEnd, ProducerItem
from rollshard.store.loader.protocol import NoStepError, NoStepWarning
from rollshard.store.loader.read import BlockData
from rollshard.store.loader.steps import (
    PrefetchingLoader,
    RolloutLoader,
    check_state_header,
    check_state_settings,
    open_stream,
    own_state,
)
from rollshard.store.loader.stream import GroupStream

__all__ = ["MixtureLoader", "Source", "allocate", "open_loader", "parse_sources", "sources_text"]

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a source name: safe in a metric key and a file name


@dataclasses.dataclass(frozen=True, kw_only=True)
class Source:
    """One dataset of a mixture."""

    name: str  # metrics: source/<name>/...
    path: str  # dataset directory or URI
    weight: Fraction | None  # None: not given (equal weights)


# -- parsing ----------------------------------------------------------------------------------


def parse_sources(spec: str) -> list[Source]:
    """The sources of ``--data`` (module docstring for the rule); ValueError, one line, on a bad entry."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("--data is empty: pass a dataset, or several as PATH:WEIGHT,PATH:WEIGHT")
    entries = [e.strip() for e in spec.split(",")]
    if any(not e for e in entries):
        raise ValueError(f"--data {spec!r} has an empty entry; separate sources with one comma: a:0.7,b:0.3")
    parsed = [_parse_entry(e) for e in entries]
    weighted = [w is not None for _, _, w in parsed]
    if any(weighted) and not all(weighted):
        missing = next(p for (_, p, w) in parsed if w is None)
        raise ValueError(f"--data {spec!r}: {missing} has no weight; give every source one (a:0.7,b:0.3) or none")
    seen: dict[str, str] = {}
    for _, path, _ in parsed:
        key = _identity(path)
        if key in seen:
            raise ValueError(f"--data {spec!r}: {path} is listed twice; list each dataset once and weigh it")
        seen[key] = path
    names = _unique_names([n if n is not None else _default_name(p) for n, p, _ in parsed])
    return [Source(name=n, path=p, weight=w) for n, (_, p, w) in zip(names, parsed)]


def sources_text(items: Sequence[dict | str]) -> str:
    """A YAML list of sources (``{path, weight[, name]}`` mappings or ``PATH[:WEIGHT]`` strings) as the ``--data``
    string."""
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
            continue
        if not isinstance(item, dict) or "path" not in item or set(item) - {"path", "weight", "name"}:
            raise ValueError(f"data.path list item {item!r}: write {{path: DIR, weight: W}} (and optionally name)")
        text = str(item["path"])
        if item.get("name") is not None:
            text = f"{item['name']}={text}"
        if item.get("weight") is not None:
            text += f":{item['weight']}"
        out.append(text)
    bad = [p for p in out if "," in p]
    if bad:
        raise ValueError(f"data.path {bad[0]!r}: a source path may not hold a comma")
    return ",".join(out)


def _parse_entry(entry: str) -> tuple[str | None, str, Fraction | None]:
    name, path = None, entry
    head, eq, rest = entry.partition("=")
    if eq and NAME.fullmatch(head):
        name, path = head, rest
    weight = None
    body, colon, tail = path.rpartition(":")
    if colon:
        text = tail.strip()
        if not text:
            raise ValueError(f"--data {entry!r} ends in ':' without a weight; write PATH:WEIGHT, e.g. {body}:0.5")
        try:
            value = float(text)
        except ValueError:
            value = None  # not a number: part of the path (s3://bucket/x)
        if value is not None:
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--data {entry!r}: weight {text} must be a positive finite number, e.g. {body}:0.5")
            weight, path = Fraction(repr(value)), body
    if not path:
        raise ValueError(f"--data {entry!r} has no path")
    return name, path, weight


def _identity(path: str) -> str:
    if "://" in path:
        return path.rstrip("/")
    return str(Path(path).expanduser().resolve())


def _default_name(path: str) -> str:
    last = path.rstrip("/").rsplit("/", 1)[-1] if "://" in path else Path(_identity(path)).name
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", last).lstrip("_.-")  # "/_" in a metric key marks a partial sum
    return name or "data"


def _unique_names(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        candidate, k = name, 2
        while candidate in out:
            candidate, k = f"{name}-{k}", k + 1
        out.append(candidate)
    return out


# -- allocation -------------------------------------------------------------------------------


def integer_weights(weights: Sequence[Fraction | None]) -> list[int]:
    """The weights normalized, as integers over their common denominator (equal when none is given)."""
    ws = [Fraction(1) if w is None else Fraction(w) for w in weights]
    total = sum(ws)
    norm = [w / total for w in ws]
    denominator = math.lcm(*(w.denominator for w in norm))
    ints = [int(w * denominator) for w in norm]
    g = math.gcd(*ints)
    return [w // g for w in ints]


def next_source(weights: Sequence[int], taken: Sequence[int]) -> int:
    """The source of the next slot ``s = sum(taken)``: argmax_i ``W_i (s + 1) - T taken_i``, ties to the first."""
    s1, total = sum(taken) + 1, sum(weights)
    best, arg = None, 0
    for i, (w, t) in enumerate(zip(weights, taken)):
        v = w * s1 - total * t
        if best is None or v > best:
            best, arg = v, i
    return arg


def allocate(
    weights: Sequence[Fraction | float | int | None], slots: int, start: Sequence[int] | None = None
) -> list[int]:
    """The source index of each of the next ``slots`` slots, after ``start`` (slots taken so far per source)."""
    ints = integer_weights([None if w is None else Fraction(repr(w)) if isinstance(w, float) else w for w in weights])
    taken = list(start) if start is not None else [0] * len(ints)
    out = []
    for _ in range(slots):
        i = next_source(ints, taken)
        taken[i] += 1
        out.append(i)
    return out


# -- the loader -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _SourceCursor:
    epoch: int = 0
    position: int = 0  # raw groups of the source's epoch stream already examined
    taken: int = 0  # slots the schedule gave this source
    kept: int = 0  # groups of the current epoch that passed the filters


@dataclasses.dataclass(frozen=True)
class _MixCursor:
    sources: tuple[_SourceCursor, ...]
    step: int = 0  # index of the next step
    ended: bool = False  # a source ran out: nothing follows


class _Segments:
    """The staleness validity of a step planned from several sources: every source's plan must hold."""

    def __init__(self, segs: list[Segment]):
        self.segs = segs

    def holds_for(self, threshold: int | None) -> bool:
        return all(s.holds_for(threshold) for s in self.segs)


class MixtureLoader(PrefetchingLoader):
    """Iterable of :class:`Step` drawn from several datasets by weight; see the module docstring.

    The same interface as :class:`RolloutLoader` (iteration from the cursor, ``state_dict``,
    ``set_current_version``, ``close``, ``epoch_stats``, ``num_groups``), plus ``sources``,
    ``datasets`` and :attr:`groups_before_end`.
    """

    def __init__(
        self,
        sources: Sequence[Source] | str,
        config: LoaderConfig | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        sync: Sync | None = None,
    ):
        config = self._set_placement(config, rank, world_size, sync)
        self.sources = tuple(parse_sources(sources) if isinstance(sources, str) else sources)
        if len(self.sources) < 2:
            raise ValueError("a mixture needs two sources or more; read one dataset with RolloutLoader")
        self.names = tuple(s.name for s in self.sources)
        self.weights = integer_weights([s.weight for s in self.sources])
        self._datasets = [RolloutDataset.open(s.path) for s in self.sources]
        checks = CheckThread(f"rollshard-checksum-{rank}")  # one thread hashes every source's blocks
        self._streams = [open_stream(ds, config, rank, world_size, checks) for ds in self._datasets]
        self._num_groups = sum(st.num_groups for st in self._streams)
        self._cursor = _MixCursor(sources=tuple(_SourceCursor() for _ in self.sources))
        self._epoch_counts: dict[str, float] = {}
        self._init_common()

    @property
    def datasets(self) -> list[RolloutDataset]:
        return self._datasets

    @property
    def num_groups(self) -> int:
        return self._num_groups

    @property
    def groups_before_end(self) -> int | None:
        """About how many groups the mixture delivers before a source runs out (before filtering; None: forever)."""
        if self.config.num_epochs is None:
            return None
        total = sum(self.weights)
        return min(st.num_groups * self.config.num_epochs * total // w for st, w in zip(self._streams, self.weights))

    def state_dict(self) -> dict:
        """The cursor after the last step taken, per source, and what it is valid for (JSON-serializable)."""
        c, total = self._cursor, sum(self.weights)
        return {
            "format": MIXTURE_STATE_FORMAT,
            "version": FILE_ORDER_STATE_VERSION if self._streams[0].file_order else STATE_VERSION,
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
            "shuffle_window": self.config.shuffle_window,
            "groups_per_step": self.config.groups_per_step,  # the shares' target depends on these two (plan.py)
            "tail": self.config.tail,
            "step": c.step,
            "ended": c.ended,
            "sources": [
                {
                    "name": src.name,
                    "path": src.path,
                    "weight": str(Fraction(w, total)),
                    "dataset": ds.fingerprint,
                    **dataclasses.asdict(sc),
                }
                for src, w, ds, sc in zip(self.sources, self.weights, self.datasets, c.sources)
            ],
            "current_version": self._version.current.text,
            "counts": dict(self._epoch_counts),
        }

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Resume at the step after the one the state was taken at; raises :class:`LoaderStateError` on a mismatch.

        ``state``: this rank's ``state_dict()``, or the list of every rank's (in rank order)."""
        state = own_state(state, self.rank, self.world_size)
        check_state_header(state, MIXTURE_STATE_FORMAT)
        mine = self.state_dict()
        check_state_settings(state, mine)
        theirs = state.get("sources") or []
        if [s.get("name") for s in theirs] != list(self.names):
            raise LoaderStateError(
                f"loader state mixes sources {', '.join(str(s.get('name')) for s in theirs)}, this loader "
                f"{', '.join(self.names)}: the source list changed; resume with the --data of the checkpoint"
            )
        if [s.get("weight") for s in theirs] != [s["weight"] for s in mine["sources"]]:
            show = lambda ss: ", ".join(f"{s['name']}:{float(Fraction(s['weight'])):g}" for s in ss)  # noqa: E731
            raise LoaderStateError(
                f"loader state has weights {show(theirs)}, this loader {show(mine['sources'])}: the weights changed, "
                "and the allocation of groups to sources depends on them; resume with the weights of the checkpoint"
            )
        for t, m in zip(theirs, mine["sources"]):
            if t.get("dataset") != m["dataset"]:
                raise LoaderStateError(
                    f"source {m['name']} ({m['path']}): loader state has dataset={t.get('dataset')!r}, this loader "
                    f"dataset={m['dataset']!r}: its shards were added, removed or rewritten since the checkpoint; "
                    "resume on the same shards or start a new run"
                )
        self._stop_producer()
        if state["version"] <= FILE_ORDER_STATE_VERSION:  # its cursors count groups in the files' order
            for stream in self._streams:
                stream.file_order = True
            self._held = {}
        fields = [f.name for f in dataclasses.fields(_SourceCursor)]
        self._cursor = _MixCursor(
            sources=tuple(_SourceCursor(**{k: int(t[k]) for k in fields}) for t in theirs),
            step=int(state["step"]),
            ended=bool(state["ended"]),
        )
        self._epoch_counts = dict(state.get("counts") or {})
        if state.get("current_version") is not None:
            self.set_current_version(state["current_version"])

    # -- internals ----------------------------------------------------------------------------

    def _check_ready(self) -> None:
        super()._check_ready()
        if self.config.num_epochs is None:
            for src, st in zip(self.sources, self._streams):
                if st.num_groups == 0:
                    raise ValueError(f"source {src.name} ({src.path}): the dataset has no groups to loop over")

    def _close_streams(self) -> None:
        for st in getattr(self, "_streams", None) or []:
            st.checksums.close()

    def _produce(self) -> Callable[[threading.Event], Iterator[ProducerItem]]:
        # the thread holds the mixer and a view of the version, never the loader, so an abandoned loader is freed
        mixer = _Mixer(self._streams, self.sources, self.weights, self.config, self.rank, self.world_size)
        start, counts, version = self._cursor, dict(self._epoch_counts), self._version
        # copied: a producer that outlived close() cannot touch it
        preloaded = {i: dict(h) for i, h in self._held.items()}
        held: dict[int, dict] = {i: {} for i in range(len(self._streams))}
        self._held = held
        return lambda stop: mixer.items(start, counts, preloaded, held, version, stop)


def open_loader(
    data: str, config: LoaderConfig | None = None, *, rank: int = 0, world_size: int = 1, sync: Sync | None = None
):
    """The loader of ``--data``: :class:`RolloutLoader` for one source (today's behaviour exactly), else a
    :class:`MixtureLoader`. ``sync``: the agreement callback between ranks (store/loader)."""
    sources = parse_sources(data)
    if len(sources) == 1:
        return RolloutLoader(sources[0].path, config, rank=rank, world_size=world_size, sync=sync)
    return MixtureLoader(sources, config, rank=rank, world_size=world_size, sync=sync)


# -- the mixed stream -------------------------------------------------------------------------


class _Mixer:
    """This rank's mixed step stream, as a deterministic function of the cursor."""

    def __init__(
        self, streams: list[GroupStream], sources: Sequence[Source], weights: list[int], cfg: LoaderConfig, rank: int,
        world_size: int,
    ):
        self.streams, self.weights, self.cfg = streams, weights, cfg
        self.names, self.paths = tuple(s.name for s in sources), tuple(s.path for s in sources)
        self.rank, self.world_size = rank, world_size

    @contextlib.contextmanager
    def _naming(self, i: int) -> Iterator[None]:
        """A :class:`DataError` of source ``i``'s data names the source: its shard paths are relative to its dataset,
        and two sources may hold shards of the same name."""
        try:
            yield
        except DataError as e:
            raise DataError(f"source {self.names[i]} ({self.paths[i]}): {e}") from e

    def items(
        self, start: _MixCursor, counts: dict, preloaded: dict, held: dict, version: VersionBox, stop: threading.Event
    ) -> Iterator[ProducerItem]:
        if start.ended:
            return
        cfg, full = self.cfg, self.cfg.groups_per_step
        cur = [dataclasses.asdict(c) for c in start.sources]  # mutable per-source cursors
        readers, gens = [], []
        try:
            for i, st in enumerate(self.streams):
                at = Cursor(cur[i]["epoch"], cur[i]["position"], 0)
                readers.append(st.reader(at, preloaded.get(i, {})))
                gens.append(st.groups(at, readers[-1], held[i], stop))
            stats: collections.Counter = collections.Counter(counts)
            step = start.step
            new_segs = lambda: [Segment(version.current.threshold, st.filters) for st in self.streams]  # noqa: E731
            pending: list[tuple[BlockData, int, np.ndarray]] = []
            owners: list[int] = []
            segs = new_segs()
            epochs_ended = [False]
            while True:
                i = next_source(self.weights, [c["taken"] for c in cur])
                with self._naming(i):
                    got = self._draw(i, gens[i], segs[i], cur[i], stats, epochs_ended)
                if got is None:
                    break
                pending.append(got)
                owners.append(i)
                cur[i]["taken"] += 1
                if len(pending) == full:
                    after = self._cursor(cur, step + 1)
                    yield self._step(pending, owners, segs, after, step, stats, stop, self._cursor(cur, step, True))
                    step += 1
                    if epochs_ended[0]:  # epoch_stats follows the sources' epochs (module docstring)
                        yield ProducerItem(step=None, cursor=after, epoch_counts=dict(stats), segment=_Segments(new_segs()))
                        epochs_ended[0] = False
                    pending, owners, segs = [], [], new_segs()
            stats[f"source/{self.names[i]}/exhausted"] = 1
            if pending and cfg.tail == "partial":
                after = self._cursor(cur, step + 1, ended=True)
                yield self._step(pending, owners, segs, after, step, stats, stop, self._cursor(cur, step, True))
                step += 1
                pending, owners, segs = [], [], new_segs()
            self._count(stats, segs)
            stats["tail_dropped_groups"] += len(pending)
            for o in owners:
                stats[f"source/{self.names[o]}/tail_dropped_groups"] += 1
            if stats["steps"] == 0:
                warnings.warn(
                    f"the mixture yields no step: source {self.names[i]} ran out after {cur[i]['taken']} groups, a "
                    f"step needs {full} (groups_per_step); loosen the filters, lower groups_per_step, "
                    "or set tail='partial'",
                    NoStepWarning,
                    stacklevel=2,
                )
            end = self._cursor(cur, step, ended=True)
            yield ProducerItem(step=None, cursor=end, epoch_counts=dict(stats), segment=_Segments(segs), end=True)
        finally:
            for g in gens:
                g.close()
            for r in readers:
                r.close()

    def _draw(self, i: int, gen, seg: Segment, c: dict, stats: collections.Counter, epochs_ended: list[bool]):
        """The next group of source ``i`` that passes its filters, ``(block, index, rows kept)``; None when the
        source has run its epochs."""
        for g in gen:
            if isinstance(g, EpochEnd):
                name = self.names[i]
                if c["kept"] == 0 and self.cfg.num_epochs is None:
                    raise NoStepError(
                        f"source {name}: epoch {g.epoch} yields no group: none of its {g.num_groups} groups pass the "
                        "filters; loosen the filters or leave the source out"
                    )
                stats[f"source/{name}/epochs"] += 1
                c.update(epoch=g.epoch + 1, position=0, kept=0)
                epochs_ended[0] = True
                continue
            epoch, position, bd, j = g
            kept = seg.examine(bd, j)
            c.update(epoch=epoch, position=position)
            if kept is not None:
                c["kept"] += 1
                return bd, j, kept
        return None

    @staticmethod
    def _cursor(cur: list[dict], step: int, ended: bool = False) -> _MixCursor:
        return _MixCursor(sources=tuple(_SourceCursor(**c) for c in cur), step=step, ended=ended)

    def _count(self, stats: collections.Counter, segs: list[Segment]) -> dict[str, int]:
        """Add the segments' filter counts to the run's (in total and per source); return their total."""
        total = dict.fromkeys(FILTER_KEYS, 0)
        for name, seg in zip(self.names, segs):
            for k, v in seg.counts.items():
                total[k] += v
                stats[f"source/{name}/{k}"] += v
        stats.update(total)
        return total

    def _step(self, pending, owners, segs, after: _MixCursor, index: int, stats, stop, ended: _MixCursor) -> ProducerItem:
        """The step of ``pending``, with the end to take instead (``ended``) when another rank has no step."""
        for i, st in enumerate(self.streams):  # each source's shards, by its own checksums
            with self._naming(i):
                st.wait_verified([p for p, o in zip(pending, owners) if o == i], stop)
        counts = self._count(stats, segs)
        stats["steps"] += 1
        for o in owners:
            stats[f"source/{self.names[o]}/groups"] += 1
        step: Step = make_step(
            pending, counts, epoch=after.sources[0].epoch, index=index, cfg=self.cfg, sources=self.names, owners=owners
        )
        step.metrics.update({f"source/{n}/epoch": float(c.epoch) for n, c in zip(self.names, after.sources)})
        cut = collections.Counter(stats)  # the step's groups left undelivered, as a tail
        cut.update(steps=-1, tail_dropped_groups=len(pending))
        for o in owners:
            cut[f"source/{self.names[o]}/groups"] -= 1
            cut[f"source/{self.names[o]}/tail_dropped_groups"] += 1
        end = ProducerItem(step=None, cursor=ended, epoch_counts=dict(cut), segment=_Segments(segs), end=True)
        return ProducerItem(step=step, cursor=after, epoch_counts=dict(stats), segment=_Segments(segs), cut=end)

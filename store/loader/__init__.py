"""The streaming loader: committed shards in, optimizer steps of whole GRPO groups out.

The trainer never holds the dataset. :class:`RolloutLoader` reads one block (a Parquet row group;
several when a group spans row groups of one shard) at a time on a background thread, keeps at most
one shuffle window of groups, and packs each step's sequences into flat micro-batches
(store/loader/packing.py) on a second background thread. The stages, one module each:

* config.py: :class:`LoaderConfig`, :class:`Step` and the names both use;
* blocks.py: the dataset's blocks, from the manifest's row groups (no row group read at open; an older
  manifest: a scan of the ``group_id`` column), and the check that no group spans two shards;
* plan.py: the epoch's block order, each rank's share of it, its shuffle windows, the cursor;
* read.py: one block read (column projection) and checked; filters.py: which rows and groups pass;
* stream.py: a rank's groups filtered and cut into steps; assemble.py: a step from its groups, packed into
  micro-batches (packing.py);
* background.py: the reader and producer threads; steps.py: the loaders, ``sync`` and resume;
* hf.py: :func:`hf_groups`, the same groups as a HF ``datasets.IterableDataset``.

**Each rank reads its own share.** The blocks are put in an order drawn from ``(seed, epoch)`` and
dealt to the ranks, balanced by tokens, the last few (the remainder) sliced by groups so that every rank
gets at least the same target (plan.py); the ranks' groups are disjoint and their union over an epoch is
the filtered dataset with each group once, but the tail (under ``world_size x groups_per_step`` groups;
under ``world_size`` with ``tail="partial"``). A rank reads and decodes only its own blocks
(:attr:`RolloutLoader.read_stats`): at most ``1/W + (1 + R)/B`` of a dataset of ``B`` equal blocks with
``R`` remainder blocks (plan.py). Measured (tests/bench/bench_loader_ranks.py: 1,200 groups in 78 row
groups of 2 MB, one epoch per rank, every byte read through the filesystem, data checks on): the busiest
rank reads 1.004 / 0.518 / 0.264 / 0.137 of the dataset at W = 1 / 2 / 4 / 8 (0.137 with checks off),
and leaves 0 / 0 / 16 / 48 groups of 1,200 unused (the tail, under W x 8). Within its share a rank cuts
consecutive windows of ``shuffle_window`` groups, permutes each by ``(seed, epoch, window)``, and cuts
steps of ``groups_per_step`` groups that pass the filters. A world size of 1 is exactly the stream of
before. A dataset of fewer than ``MIN_BLOCKS_PER_RANK`` blocks per rank is not dealt: every rank reads
every block and takes every ``world_size``-th group of the one-rank stream (plan.py).

**The same number of steps on every rank** (FSDP's collectives need it). Without filters that drop
whole groups it holds with no communication: every rank knows every rank's share, so no rank takes more
than the smallest share allows (``step_cap``, plan.py). Filters can leave one rank fewer steps, which
no rank knows without reading, so the loader takes an agreement callback ``sync(state: int) -> int``
from the trainer: this rank's state (``SYNC_STEP`` it has a step, ``SYNC_END`` its epoch ended,
``SYNC_FAILED`` its loader raised) in, the least state of every rank out (an all-reduce with min). It
is called on the iterating thread before each step is yielded, at each end of a rank's epoch, and once
by a rank whose loader raises (a damaged block only its share holds, an epoch without a step) before
it raises, so the others raise :class:`PeerFailedError` instead of waiting in the collective. When no
rank failed but one has no step, the epoch ends on every rank at once, and a rank that had a step drops
it (its groups counted as ``tail_dropped_groups``, its share's groups not yet examined as
``left_groups``). Without a
callback (a world size of 1, or ranks simulated in one process) each rank yields every step of its own
share up to the cap: deterministic, but with filters ranks may then take different numbers of steps.

**Tail.** ``tail="drop"`` (the default) drops a rank's last incomplete step of an epoch;
``tail="partial"`` yields it as a smaller step (it then counts towards ``step_cap``, rounded up). Epoch
counts are in :attr:`RolloutLoader.epoch_stats`. Nothing is ever duplicated.

**Filters**, each counted by reason in ``Step.metrics`` (filters.py): status, agent, a missing
reward, staleness, then empty and (optionally) zero-variance groups. Every figure of ``Step.metrics``
is this rank's (the filter counts of the groups it examined, and its packing figures); the global
step's are their sums over the ranks.

**Exact resume.** Each rank's cursor is ``(epoch, position in its share's stream, step index)``: the
position counts raw groups (before filtering), so a resume re-reads only the current window's blocks.
The state holds the rank and the world size: a checkpoint keeps every rank's state (the trainer
all-gathers them) and :meth:`RolloutLoader.load_state_dict` takes this rank's, or the list of all; a
different world size or rank is refused with one line. The policy version may change between steps
(:meth:`RolloutLoader.set_current_version`); prefetched steps are re-planned when a change falls
outside the versions their staleness decisions hold for.

**Damaged data never reaches a step.** A shard is checked against its manifest entry and the schema
before its rows are used, and a break raises :class:`~rollshard.store.common.DataError` (re-exported
here) out of iteration, one line naming the shard, the row (sample id) and the problem: when the
loader opens the dataset, every shard's footer, schema version, size, row groups and the exact types of
the columns read (no cast: int64 ids or float64 logprobs are refused); at every open of a file, its
size; for every block read, the row invariants on the columns read (read.py); and its bytes' hash,
checked on a third thread before any step drawn from it is handed on (stream.py). With manifest version 3
(store/format/manifest.py) that hash is per block (its XXH3-128 from version 4 on, its sha256 before): a rank
reads a block's row groups in one ranged read, hashes exactly those bytes and decodes the block from them,
and checks each shard's footer once per loader, so the checks read nothing beyond the rank's own blocks
and footers. A damaged byte in a row group another rank owns is that rank's to find; the union of the
ranks verifies every byte each epoch (every block is some rank's), and ``rollshard-store validate``
checks whole files. A shard whose manifest entry lacks the ranges (an older manifest) is hashed whole,
once per loader, so with ``verify_data`` a rank then reads the whole of every such shard one of its
blocks is in.
``LoaderConfig.verify_data=False`` turns the checks off, for measuring what they cost only.

**Sampling supports** (schema 1.1): read with the token columns from shards that have them (assemble.py).

**Memory**: one window of groups, ``prefetch`` blocks and ``prefetch`` packed steps, independent of the
dataset's size (plus one 8-byte hash per group while the dataset is opened).

**Several datasets** (``--data a:0.7,b:0.3``): store/loader/mixture.py draws each dataset's group stream of
this rank (:meth:`stream.GroupStream.groups`) and fills each step's group slots from them by weight.
"""

from rollshard.store.common import DataError
from rollshard.store.loader.config import (
    FILTER_KEYS,
    SAMPLING_COLUMNS,
    NO_VERSION,
    SMALL_COLUMNS,
    SYNC_END,
    SYNC_FAILED,
    SYNC_STEP,
    TOKEN_COLUMNS,
    LoaderConfig,
    LoaderStateError,
    PeerFailedError,
    Step,
    Sync,
)
from rollshard.store.loader.hf import HF_GROUP_SCHEMA, hf_groups
from rollshard.store.loader.packing import PackedBatch
from rollshard.store.loader.protocol import NoStepError, NoStepWarning, StepLoader, WrappedLoader
from rollshard.store.loader.steps import RolloutLoader

__all__ = [
    "DataError",
    "FILTER_KEYS",
    "HF_GROUP_SCHEMA",
    "NO_VERSION",
    "SAMPLING_COLUMNS",
    "SMALL_COLUMNS",
    "SYNC_END",
    "SYNC_FAILED",
    "SYNC_STEP",
    "TOKEN_COLUMNS",
    "LoaderConfig",
    "LoaderStateError",
    "NoStepError",
    "NoStepWarning",
    "PackedBatch",
    "PeerFailedError",
    "RolloutLoader",
    "Step",
    "StepLoader",
    "Sync",
    "WrappedLoader",
    "hf_groups",
]

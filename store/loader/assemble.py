"""A step from its groups: the rows as sequences, packed into micro-batches (store/loader/packing.py).

Sequences are packed into flat micro-batches of at most ``micro_batch_tokens`` tokens (no padding) and
at most ``micro_batch_support`` schema 1.1 support ids (a sequence over either gets one of its own);
:class:`PackedBatch` carries ``sampling_logprobs``, ``has_support``, ``support_ids`` and
``support_offsets`` for each micro-batch with a supported row, None otherwise.
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from rollshard.store.format.groups import is_zero_variance
from rollshard.store.loader.config import SOURCE_KEYS, LoaderConfig, Step
from rollshard.store.loader.packing import PackedStep, Sequences, pack_step
from rollshard.store.loader.read import BlockData


def make_step(
    pending: list[tuple[BlockData, int, np.ndarray]],
    counts: dict[str, int],
    *,
    epoch: int,
    index: int,
    cfg: LoaderConfig,
    sources: tuple[str, ...] | None = None,
    owners: list[int] | None = None,
) -> Step:
    """This rank's step of ``pending`` groups ``(block, index in block, rows kept)``, packed.

    ``counts``: the filter counts of the groups examined for it. A mixture (store/loader/mixture.py) gives the
    source names and each pending group's source index (``owners``): the step then carries
    :attr:`Step.group_sources` and per-source figures.
    """
    seqs, zero_var = gather_sequences(pending)
    packed = pack_step(seqs, cfg.micro_batch_tokens, cfg.micro_batch_support)
    batches, efficiency = packed.batches, packed.efficiency
    metrics = {k: float(v) for k, v in counts.items()}
    metrics.update(
        groups=float(len(pending)),
        sequences=float(len(seqs)),
        tokens=float(sum(b.num_tokens for b in batches)),
        loss_tokens=float(sum(b.num_loss_tokens for b in batches)),
        micro_batches=float(len(batches)),
        packing_efficiency=efficiency,
        zero_variance_groups=float(zero_var),
    )
    group_sources = None
    if sources is not None:
        group_sources = [sources[i] for i in owners]  # [G]
        metrics.update(source_metrics(owners, sources, packed))
    if cfg.pin_memory and torch.cuda.is_available():
        batches = [b.pin_memory() for b in batches]
    return Step(
        micro_batches=batches,
        group_ids=[bd.group_ids[j] for bd, j, _ in pending],
        epoch=epoch,
        index=index,
        metrics=metrics,
        group_sources=group_sources,
    )


def source_metrics(owners: list[int], sources: tuple[str, ...], packed: PackedStep) -> dict[str, float]:
    """``source/<name>/{groups,sequences,tokens,loss_tokens}`` of this rank's step, 0 for a source without any
    (``owners``: the source index of each group), from the step's per-sequence figures."""
    of_group = np.asarray(owners, np.int64)  # [G]
    src, k = of_group[packed.group], len(sources)  # [S] the source of each sequence
    sums = {  # [k] each; integers, exact in float64
        "groups": np.bincount(of_group, minlength=k).astype(np.float64),
        "sequences": np.bincount(src, minlength=k).astype(np.float64),
        "tokens": np.bincount(src, weights=packed.tokens, minlength=k),
        "loss_tokens": np.bincount(src, weights=packed.loss_tokens, minlength=k),
    }
    return {f"source/{name}/{key}": float(sums[key][i]) for i, name in enumerate(sources) for key in SOURCE_KEYS}


def gather_sequences(groups: list[tuple[BlockData, int, np.ndarray]]) -> tuple[Sequences, int]:
    cols: dict[str, list] = collections.defaultdict(list)
    zero_var = 0
    for g, (bd, _, rows) in enumerate(groups):
        zero_var += is_zero_variance(bd.reward[rows])
        for row in rows.tolist():
            cols["prompt"].append(bd.row_tokens("prompt_tokens", row))
            cols["response"].append(bd.row_tokens("response_tokens", row))
            cols["logprobs"].append(bd.row_tokens("rollout_logprobs", row))
            cols["mask"].append(bd.row_tokens("loss_mask", row))
            cols["temperature"].append(bd.temperature[row])
            cols["reward"].append(bd.reward[row])
            cols["group"].append(g)
            cols["agent"].append(bd.agent[row])
            cols["sample_id"].append(bd.sample_id[row])
            cols["weight_version"].append(bd.weight_version[row])
            cols["oldest_version"].append(bd.oldest[row])
            support = bd.row_support(row)
            cols["support"].append(support)
            cols["sampling_logprobs"].append(None if support is None else bd.row_tokens("sampling_logprobs", row))
            cols["routing"].append(bd.row_routing(row))
    any_support = any(s is not None for s in cols["support"])
    seqs = Sequences(
        prompt=cols["prompt"],
        response=cols["response"],
        logprobs=cols["logprobs"],
        mask=cols["mask"],
        temperature=np.asarray(cols["temperature"], np.float32),
        reward=np.asarray(cols["reward"], np.float32),
        group=np.asarray(cols["group"], np.int64),
        agent=cols["agent"],
        sample_id=cols["sample_id"],
        weight_version=cols["weight_version"],
        oldest_version=np.asarray(cols["oldest_version"], np.int64),
        sampling_logprobs=cols["sampling_logprobs"] if any_support else None,
        support=cols["support"] if any_support else None,
        routing=cols["routing"] if any(r is not None for r in cols["routing"]) else None,
    )
    return seqs, zero_var


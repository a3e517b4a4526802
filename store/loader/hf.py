"""HF ``datasets`` users get the loader's groups through :func:`hf_groups`: one example per group."""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.io.integrity import check_column_types, open_shard, verify_sha256
from rollshard.store.loader.blocks import Block, hash_group_ids, read_group_ids, shard_blocks
from rollshard.store.loader.config import SAMPLING_COLUMNS, SMALL_COLUMNS, TOKEN_COLUMNS, LoaderConfig
from rollshard.store.loader.filters import Filters, Segment, parse_version
from rollshard.store.loader.read import read_block
from rollshard.store.format.manifest import ShardInfo
from rollshard.store.io.storage import Storage


HF_GROUP_SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("sample_id", pa.list_(pa.string())),
        ("agent", pa.list_(pa.string())),
        ("weight_version", pa.list_(pa.string())),
        ("reward", pa.list_(pa.float32())),
        ("temperature", pa.list_(pa.float32())),
        ("prompt_tokens", pa.list_(pa.list_(pa.int32()))),
        ("response_tokens", pa.list_(pa.list_(pa.int32()))),
        ("rollout_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("loss_mask", pa.list_(pa.list_(pa.uint8()))),
        # schema 1.1, per row (None for a row without a support, every row of a 1.0 shard)
        ("sampling_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("sampling_support", pa.list_(pa.list_(pa.list_(pa.int32())))),
        # schema 1.2 with LoaderConfig.routed_experts, per row: [P + R - 1, layers x top_k] expert ids, or None
        ("routed_experts", pa.list_(pa.list_(pa.list_(pa.int32())))),
    ]
)


def hf_groups(dataset: RolloutDataset | str | os.PathLike, config: LoaderConfig | None = None):
    """The loader's groups as a HF ``datasets.IterableDataset``, one example per group.

    The same row and group filters as :class:`RolloutLoader` (staleness against
    ``config.current_version``), in shard order. Each shard file is one HF shard, so
    ``datasets.distributed.split_dataset_by_node`` keeps groups whole: it hands out whole
    shards when their number divides by the world size, and every world_size-th group
    otherwise. Shuffling (``.shuffle(seed, buffer_size)``), batching and packing are then
    HF's and the user's; HF's resume of a shuffled stream is not exact. Each shard is checked
    as the loader checks it (with ``verify_data``), its sha256 before its first group is yielded.
    """
    import datasets

    ds = dataset if isinstance(dataset, RolloutDataset) else RolloutDataset.open(dataset)
    cfg = dataclasses.asdict(config or LoaderConfig())
    if cfg["max_staleness"] is not None and cfg["current_version"] is None:
        raise ValueError("max_staleness needs LoaderConfig.current_version")
    return datasets.IterableDataset.from_generator(
        _hf_generate,
        features=datasets.Features.from_arrow_schema(HF_GROUP_SCHEMA),
        # one list entry per shard: HF splits gen_kwargs lists into its shards
        gen_kwargs={"shards": [dataclasses.asdict(s) for s in ds.shards],
                    "root": ds.storage.root if ds.storage.local else ds.storage.uri, "config": cfg},
    )


def _hf_generate(shards: list[dict], root: str, config: dict) -> Iterator[dict]:
    cfg = LoaderConfig(**config)
    filters = Filters.of(cfg)
    threshold = None
    if cfg.max_staleness is not None:
        threshold = parse_version(cfg.current_version, "current_version") - cfg.max_staleness
    storage = Storage(root)
    for info in map(ShardInfo.from_dict, shards):
        f, pf = open_shard(storage, info)
        with f:
            if cfg.verify_data:
                check_column_types(pf.schema_arrow, SMALL_COLUMNS + TOKEN_COLUMNS + SAMPLING_COLUMNS, info.path)
                verify_sha256(storage, info)  # whole before its first group: HF has no step to hold back
            yield from _hf_shard_groups(pf, info.path, filters, threshold, cfg.verify_data)


def _hf_shard_groups(pf: pq.ParquetFile, shard: str, filters: Filters, threshold, check: bool) -> Iterator[dict]:
    for rgs, n in shard_blocks([hash_group_ids(ids) for ids in read_group_ids(pf, shard)]):
        bd = read_block(pf, Block(shard=-1, row_groups=rgs, num_groups=n), filters, shard, check)
        seg = Segment(threshold, filters)
        for j in range(len(bd.group_ids)):
            rows = seg.examine(bd, j)
            if rows is None:
                continue
            rows = rows.tolist()
            yield {
                "group_id": bd.group_ids[j],
                "sample_id": [bd.sample_id[r] for r in rows],
                "agent": [bd.agent[r] for r in rows],
                "weight_version": [bd.weight_version[r] for r in rows],
                "reward": bd.reward[rows].tolist(),
                "temperature": bd.temperature[rows].tolist(),
                **{name: [bd.row_tokens(name, r).tolist() for r in rows] for name in TOKEN_COLUMNS},
                "sampling_logprobs": [None if bd.row_support(r) is None else bd.row_tokens("sampling_logprobs", r).tolist()
                                      for r in rows],
                "sampling_support": [bd.row_support_lists(r) for r in rows],
                "routed_experts": [None if (ids := bd.row_routing(r)) is None else ids.tolist() for r in rows],
            }


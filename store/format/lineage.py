"""Lineage of a derived dataset: which dataset it was made from, by which operation, with what settings.

A derived dataset (``rollshard-store filter``, ``rollshard-generate rescore``, any
:func:`rollshard.store.derived.derive.derive_dataset`) has one writer per writer of its parent,
and each writer's manifest config (also the key/value metadata of the shards that writer
rewrote) is the parent writer's config with three keys set::

    {
      ...every key of the parent writer's config...   # generation settings: sampling, agents, model, tokenizer
      "command": "rollshard-store filter",             # what wrote this dataset
      "derived": {                                     # this derivation
        "operation": "filter",                         # filter | rescore | ...
        "parent": "/data/run1",                        # absolute local path, or the URI as given
        "parent_fingerprint": "3f2a...",               # RolloutDataset.fingerprint of the parent when derived
        "parent_writer": "gen-host-1",                 # the parent writer whose config this one extends
        "details": {...},                              # the operation's settings (a filter's expression, ...)
        "mutable_columns": ["metadata", "reward"],     # the columns the operation was allowed to change
        "command": "rollshard-store filter",
        "created_at": "2026-01-01T00:00:00.000+00:00",
      },
      "lineage": [derived entry, parent's entries...]  # newest first; [] or absent for a generated dataset
    }

Keeping the parent's generation keys at the top level is what makes a derived dataset
trainable and inspectable exactly as its parent: the trainer's Dr. GRPO length
(``sampling.max_new_tokens``, ``agents``) and ``inspect``'s tokenizer lookup read the
same keys, and one manifest per parent writer keeps writers with different settings apart.

A shard the derive copied byte for byte keeps its parent's footer (the parent's config,
without these keys): the manifests are where lineage is read from (:func:`lineage_of`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Collection

from rollshard.store.common import utc_now
from rollshard.store.format.manifest import Manifest

DERIVED_KEY = "derived"
LINEAGE_KEY = "lineage"
# The keys of a lineage entry that identify a derivation: a rerun into the same out must match them all.
IDENTITY_KEYS = ("operation", "parent", "parent_fingerprint", "details", "mutable_columns")


def lineage_entry(
    *,
    operation: str,
    parent: str,
    parent_fingerprint: str,
    details: dict[str, Any],
    mutable_columns: Collection[str],
    command: str,
) -> dict[str, Any]:
    """The ``derived`` record of one derivation (module docstring); ``details`` must be plain JSON."""
    if not operation or not isinstance(operation, str):
        raise ValueError(
            f"operation must be a non-empty string naming the derivation (filter, rescore); got {operation!r}"
        )
    try:
        details = json.loads(json.dumps(details, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"details of {operation!r} must be plain JSON (str, number, bool, None, list, dict): {e}"
        ) from e
    if not isinstance(details, dict):
        raise ValueError(f"details of {operation!r} must be a JSON object (a dict); got {type(details).__name__}")
    return {
        "operation": operation,
        "parent": parent,
        "parent_fingerprint": parent_fingerprint,
        "details": details,
        "mutable_columns": sorted(mutable_columns),
        "command": command,
        "created_at": utc_now(),
    }


def derived_config(parent_config: dict[str, Any], entry: dict[str, Any], *, parent_writer: str) -> dict[str, Any]:
    """A derived writer's config: ``parent_config`` with ``command``, ``derived`` and ``lineage`` set."""
    parent_lineage = parent_config.get(LINEAGE_KEY)
    parent_lineage = list(parent_lineage) if isinstance(parent_lineage, list) else []
    this = {**entry, "parent_writer": parent_writer}
    return {**parent_config, "command": entry["command"], DERIVED_KEY: this, LINEAGE_KEY: [this, *parent_lineage]}


def identity(entry: dict[str, Any]) -> dict[str, Any]:
    """The part of a ``derived`` record that a rerun of the same derivation reproduces."""
    return {k: entry.get(k) for k in IDENTITY_KEYS}


def lineage_of(dataset: Any) -> list[dict[str, Any]]:
    """The lineage of a dataset, newest derivation first; ``[]`` for a generated (not derived) dataset.

    ``dataset`` is a :class:`~rollshard.store.io.dataset.RolloutDataset`, a list of
    :class:`~rollshard.store.format.manifest.Manifest`, or a path (its manifests are read, no shard
    is opened). Every writer of a derived dataset records the same lineage except for
    ``parent_writer``; the first writer's (by writer id) with a lineage is returned.
    """
    if isinstance(dataset, (str, os.PathLike)):
        from rollshard.store.format.manifest import load_manifests
        from rollshard.store.io.storage import Storage

        manifests = load_manifests(Storage(dataset))
    elif isinstance(dataset, list):
        manifests = dataset
    else:
        manifests = dataset.manifests
    for m in manifests:
        lineage = _lineage_in(m)
        if lineage:
            return lineage
    return []


def _lineage_in(manifest: Manifest) -> list[dict[str, Any]]:
    lineage = (manifest.config or {}).get(LINEAGE_KEY)
    return [e for e in lineage if isinstance(e, dict)] if isinstance(lineage, list) else []

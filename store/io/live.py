"""A dataset read while it is written: the writers' end-of-run markers.

A follower (:class:`~rollshard.store.loader.follow.FollowLoader`, ``rollshard-train --follow``) trains on
shards as their commits land; it needs to know when no more will come. Each generating writer says so
when its run has written everything it was asked for: ``DATASET/_complete/<writer_id>.json`` (what it
wrote, when). A writer that starts again (a rerun that adds prompts, a ``--repeat`` run) removes its marker
before it commits anything, so a marker never stands beside shards its writer committed after it.

The dataset is complete when every writer with a manifest has its marker; a follower that has consumed
every shard of a complete dataset ends. A dataset generated before markers existed has none: a follower
then ends only at its step budget (``--max-steps``) or its wait limit.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from rollshard.store.format.manifest import MANIFEST_DIR
from rollshard.store.io.storage import Storage

COMPLETE_DIR = "_complete"


def mark_complete(storage: Storage, writer_id: str, info: dict[str, Any] | None = None) -> None:
    """Say that ``writer_id`` will commit nothing more (atomic: the marker is whole or absent)."""
    storage.makedirs(COMPLETE_DIR)
    body = {"writer_id": writer_id, "completed_at": dt.datetime.now(dt.timezone.utc).isoformat(), **(info or {})}
    storage.write_atomic(f"{COMPLETE_DIR}/{writer_id}.json", json.dumps(body, sort_keys=True).encode())


def clear_complete(storage: Storage, writer_id: str) -> None:
    """Withdraw ``writer_id``'s marker (before it commits again); nothing when it has none."""
    rel = f"{COMPLETE_DIR}/{writer_id}.json"
    if storage.exists(rel):
        storage.delete(rel)


def complete_writers(storage: Storage) -> set[str]:
    """The writers whose marker is there."""
    if not storage.exists(COMPLETE_DIR):
        return set()
    return {name.rsplit("/", 1)[-1][: -len(".json")] for name in storage.list(COMPLETE_DIR, ".json")}


def is_complete(storage: Storage) -> bool:
    """Whether every writer with a manifest has said it is done (False for a dataset with no writer yet)."""
    if not storage.exists(MANIFEST_DIR):
        return False
    writers = {name.rsplit("/", 1)[-1][: -len(".json")] for name in storage.list(MANIFEST_DIR, ".json")}
    return bool(writers) and writers <= complete_writers(storage)

"""What a run has done, for resume: the prompts with rows in the dataset (:func:`done_prompt_ids`, skipped by a
rerun), and the failure ledger ``DATASET/_failures/<writer_id>.jsonl`` (:class:`Ledger`), one line per prompt of
this writer that failed and has no rows yet (prompt id, error, attempts in all, time).

The runner records a prompt when it gives up on it (after its retries, or at once for a permanent error) and, at
the end of the run, drops the prompts that now have rows: the file then holds exactly this writer's prompts still
missing, and a rerun of the same command retries them. Nothing is dropped silently.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from rollshard.store.format.manifest import FAILURE_DIR
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.io.storage import Storage
from rollshard.store.io.writer import ShardWriter


def done_prompt_ids(storage: Storage) -> set[str]:
    """Prompts with rows in the dataset; a run reads them after its writer adopted its crash orphans."""
    ds = RolloutDataset.open(storage)
    if not ds.shards:
        return set()
    return set(ds.read(columns=["prompt_id"]).column("prompt_id").unique().to_pylist())


class Ledger:
    """``DATASET/_failures/<writer_id>.jsonl``: one line per prompt of this writer that has no rows yet."""

    def __init__(self, writer: ShardWriter):
        self.storage = writer.storage
        self.rel = f"{FAILURE_DIR}/{writer.writer_id}.jsonl"
        self.writer_id = writer.writer_id
        self.entries: dict[str, dict[str, Any]] = {}
        self.storage.remove_atomic_leftovers(self.rel)  # a crash inside an earlier save; this writer owns the file
        if self.storage.exists(self.rel):
            for line in self.storage.read_bytes(self.rel).decode().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    self.entries[entry["prompt_id"]] = entry
        self._before = dict(self.entries)

    @property
    def path(self) -> str:
        return self.storage.path(self.rel)

    def record(self, prompt_id: str, failure: dict[str, Any]) -> None:
        previous = self._before.get(prompt_id, {}).get("attempts", 0)
        self.entries[prompt_id] = {
            "prompt_id": prompt_id,
            "error": failure["error"],
            "attempts": previous + failure["attempts"],
            "writer_id": self.writer_id,
            "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        self._save()

    def finish(self, done: set[str]) -> str | None:
        """Drop prompts that now have rows; return the ledger's path if any prompt is left in it."""
        self.entries = {k: v for k, v in self.entries.items() if k not in done}
        if self.entries:
            self._save()
            return self.path
        if self.storage.exists(self.rel):
            self.storage.delete(self.rel)
        return None

    def _save(self) -> None:
        self.storage.makedirs(FAILURE_DIR)
        data = "".join(json.dumps(e, sort_keys=True) + "\n" for e in self.entries.values())
        self.storage.write_atomic(self.rel, data.encode())


def failure_record(error: BaseException, attempts: int) -> dict[str, Any]:
    """What the ledger and the run summary say of a prompt given up on after ``attempts`` attempts."""
    text = " ".join(str(error).split()) or type(error).__name__
    return {"error": f"{type(error).__name__}: {text}", "attempts": attempts}

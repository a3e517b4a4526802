"""``RUN/loop.json``: what ``rollshard-loop`` keeps between runs of the same command, as typed records.

    {"version": 1, "settings": {...}, "rounds": [{"round": 0, "policy": ..., "generated": true, ...}, ...],
     "async_runs": [...]}

``settings`` are the resolved settings of the run (:class:`rollshard.train.loop.LoopSettings`, or
:class:`rollshard.train.async_loop.AsyncSettings` with ``"mode": "async"``), kept as the JSON object they were
written as: a rerun compares its own with them key by key, and a file of an older rollshard may lack a key.
Each round is a :class:`RoundState`; a field at its default (not reached yet) is left out of the file, so a
state reads the same whether this rollshard or an earlier one wrote it. ``async_runs`` (``--async`` only) holds
the figures of every finished run.

Written whole after every stage (temporary file, fsync, rename: a crash leaves the old state or the new).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollshard.store.common import UsageError, write_atomic

STATE_FILE = "loop.json"
STATE_VERSION = 1
LOCK_FILE = ".loop.lock"  # flock'ed by the running loop; alone in a folder it is a run that just began


@dataclass(kw_only=True)
class RoundState:
    """What round k has finished: its policy P_k, its rows, their audit, its training, its evaluations."""

    round: int
    policy: str | None = None  # P_k, relative to the run folder when inside it (a run can be moved)
    policy_version: str | None = None  # the version P_k is served as
    generated: bool = False  # its generation finished (exit 0)
    data: dict[str, Any] | None = None  # its rows: count, failed prompts, reward by agent (loop._data_summary)
    audit: dict[str, Any] | None = None  # --audit: the overall mismatch of its rows against P_k
    trained: bool = False  # its training finished and wrote a checkpoint
    checkpoint: str | None = None  # P_{k+1}: the step folder its training ended on, relative like ``policy``
    checkpoint_version: str | None = None
    train: dict[str, Any] | None = None  # its training: steps, step-0 mismatch, last loss (loop._train_summary)
    eval: dict[str, Any] | None = None  # --eval, round 0 only: the held-out figures of --model
    checkpoint_eval: dict[str, Any] | None = None  # --eval: the held-out figures of its checkpoint
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each stage that ran: generate, train, eval

    def to_json(self) -> dict[str, Any]:
        """The round as loop.json keeps it: the fields not at their defaults."""
        defaults = {f.name: f.default_factory() if callable(f.default_factory) else f.default
                    for f in dataclasses.fields(self)}  # fmt: skip
        return {k: v for k, v in dataclasses.asdict(self).items() if k == "round" or v != defaults[k]}

    @classmethod
    def from_json(cls, entry: Any, where: Path) -> RoundState:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(entry, dict) or not isinstance(entry.get("round"), int):
            raise UsageError(f"{where}: a round's entry is not an object with its round number ({entry!r:.60}); "
                             "choose a new --out")
        unknown = sorted(set(entry) - names)
        if unknown:
            raise UsageError(f"{where}: round {entry['round']} has fields this rollshard does not know "
                             f"({', '.join(unknown)}); upgrade rollshard, or choose a new --out")
        return cls(**entry)


@dataclass(kw_only=True)
class LoopState:
    """The whole of ``RUN/loop.json``."""

    settings: dict[str, Any]  # the run's settings as written (module docstring)
    rounds: list[RoundState] = field(default_factory=list)
    async_runs: list[dict[str, Any]] | None = None  # --async: the figures of each finished run; None: rounds

    @property
    def is_async(self) -> bool:
        return self.settings.get("mode") == "async"

    def to_json(self) -> dict[str, Any]:
        state: dict[str, Any] = {"version": STATE_VERSION, "settings": self.settings,
                                 "rounds": [r.to_json() for r in self.rounds]}  # fmt: skip
        if self.async_runs is not None:
            state["async_runs"] = self.async_runs
        return state

    def write(self, out: Path) -> None:
        """Replace ``out/loop.json`` whole (``out`` is made when missing)."""
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / STATE_FILE, json.dumps(self.to_json(), indent=2))

    @classmethod
    def read(cls, out: Path) -> LoopState | None:
        """The state of the run in ``out``; None for a new run (no folder, an empty one, or the lock alone).
        Raises :class:`UsageError` for a folder that is not a loop's run, or a state file that is damaged or
        of a newer rollshard."""
        path = out / STATE_FILE
        if not path.exists():
            if out.exists() and any(p.name != LOCK_FILE for p in out.iterdir()):  # a lock alone: a run that just began
                raise UsageError(f"{out} exists and is not a rollshard-loop run (no {STATE_FILE}); choose a new --out")
            return None
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"{path} is unreadable ({e}); choose a new --out") from e
        if not (isinstance(state, dict) and isinstance(state.get("settings"), dict)
                and isinstance(state.get("rounds"), list)):  # fmt: skip
            raise UsageError(f"{path} is not a rollshard-loop state file (no settings and rounds); choose a new --out")
        if state.get("version", 0) > STATE_VERSION:
            raise UsageError(f"{path} was written by a newer rollshard (state version {state['version']}); upgrade")
        runs = state.get("async_runs")
        if runs is not None and not isinstance(runs, list):
            raise UsageError(f"{path}: async_runs is not a list; choose a new --out")
        return cls(
            settings=state["settings"],
            rounds=[RoundState.from_json(r, path) for r in state["rounds"]],
            async_runs=runs,
        )

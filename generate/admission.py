"""The admission gate of an asynchronous run (``--max-ahead``): how far generation may run ahead of the trainer.

A trainer following the dataset (``rollshard-train --follow``) takes ``step_episodes`` (B) episodes per
step, in about the order they were started, and serves the weights of step ``s`` as version
``first_version + s``. Episode ``i`` (0-based, counting every prompt already in the dataset and every
episode this run started) is then trained on at step ``i // B``, by the policy of version
``first_version + i // B``. Started while the engine serves version ``v``, it is
``first_version + i // B - v`` versions stale; keeping that at most ``max_ahead`` (eta) gives

    i < (eta + 1 + v - first_version) * B

AReaL's rule (``StalenessManager.get_capacity``, areal/infra/staleness_manager.py:
``(max_staleness + current_version + 1) * consumer_batch_size - (accepted + running)``), with
the version counted from ``first_version``. Unlike AReaL, a failed episode still counts as started: its
prompt stays in the failure ledger for a rerun, and counting it only makes the bound tighter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

GATE_POLL_S = 0.05  # a closed gate re-reads the engine's weight version this often (the runner's poll)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionGate:
    max_ahead: int  # eta: versions an episode may lag the policy that trains on it
    step_episodes: int  # B: episodes per trainer step
    first_version: int = 0  # V0: the version the engine serves before the trainer's first step

    def __post_init__(self) -> None:
        assert self.max_ahead >= 0 and self.step_episodes >= 1, "checked where the flags are parsed"

    def allowed(self, version: int) -> int:
        """Episodes that may have started in all while the engine serves ``version`` (never below 0: a version
        before ``first_version`` admits nothing)."""
        return max(0, (self.max_ahead + 1 + version - self.first_version) * self.step_episodes)


def integer_version(value: Any) -> int:
    """An engine's ``weight_version`` as the trainer step it counts; ValueError when it is not an integer."""
    text = str(value).strip()
    try:
        return int(text)
    except ValueError as e:
        raise ValueError(f"the engine serves weight_version {value!r}, not the integer step --max-ahead counts") from e

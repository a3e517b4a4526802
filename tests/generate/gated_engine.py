"""An EmbeddedEngine whose worker can be stopped at a chosen decode step: tests that need a request provably
mid-decode (joining the running batch, a weight swap or an abort under it) gate on it instead of sleeping."""

from __future__ import annotations

import asyncio
import threading
import time

from rollshard.generate.engines.embedded import EmbeddedEngine

GATE_TIMEOUT_S = 120.0  # only reached when a test is broken; then it fails instead of hanging


class GatedEngine(EmbeddedEngine):
    """Records the rows of every decode step; ``block_at_step(n)`` stops the worker before the n-th step from now."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch_sizes: list[int] = []  # rows in each decode step, in order
        self.blocked = threading.Event()  # set while the worker waits at the gate
        self.release = threading.Event()
        self._block_at: int | None = None

    def block_at_step(self, n: int) -> None:
        self.blocked.clear()
        self.release.clear()
        self._block_at = len(self.batch_sizes) + n

    def decode_step(self, batch) -> None:
        self.batch_sizes.append(len(batch.rows))
        if len(self.batch_sizes) == self._block_at:
            self.blocked.set()
            if not self.release.wait(GATE_TIMEOUT_S):
                raise RuntimeError("the test never released the gate")
        super().decode_step(batch)

    async def wait_blocked(self) -> None:
        assert await asyncio.to_thread(self.blocked.wait, GATE_TIMEOUT_S), "the worker never reached the gate"


async def until(condition, timeout: float = GATE_TIMEOUT_S) -> None:
    """Poll ``condition`` on the event loop until it holds (a generous deadline, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.001)

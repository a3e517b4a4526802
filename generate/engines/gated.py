"""An engine behind a concurrency limit and a per-request timeout, as the batch runner shares it among episodes."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Any

from rollshard.generate.engines.base import Engine, EngineError, GenerateResult, SamplingParams


class GatedEngine(Engine):
    """An engine behind a concurrency limit and a per-request timeout.

    Free slots go to the waiting request of the *oldest* episode (lowest priority
    number), not first come first served: episodes then finish about in the order
    they started, so few are half done at any time (a crash loses little, the end of
    the run has no long tail) while later episodes still fill every idle slot.
    """

    def __init__(self, engine: Engine, *, concurrency: int, request_timeout: float | None):
        self.inner = engine
        self.request_timeout = request_timeout
        self._free = concurrency
        self._waiters: list[tuple[int, int, asyncio.Future]] = []  # heap of (priority, arrival, future)
        self._arrivals = itertools.count()

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None, priority: int = 0
    ) -> GenerateResult:
        await self._acquire(priority)
        try:
            if self.request_timeout is None:  # the engine enforces its own (the SGLang client does)
                return await self.inner.generate(input_ids, sampling, rid=rid)
            try:
                return await asyncio.wait_for(self.inner.generate(input_ids, sampling, rid=rid), self.request_timeout)
            except asyncio.TimeoutError as e:
                raise EngineError(f"request {rid} got no response within {self.request_timeout:g} s") from e
        finally:
            self._release()

    def for_episode(self, priority: int) -> "EpisodeEngine":
        return EpisodeEngine(self, priority)

    async def model_info(self) -> dict[str, Any]:
        return await self.inner.model_info()

    async def _acquire(self, priority: int) -> None:
        if self._free and not self._waiters:
            self._free -= 1
            return
        slot = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._arrivals), slot))
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():  # handed a slot just as it was cancelled: pass it on
                self._release()
            raise

    def _release(self) -> None:
        while self._waiters:
            _, _, slot = heapq.heappop(self._waiters)
            if not slot.done():  # cancelled waiters are skipped
                slot.set_result(None)
                return
        self._free += 1


class EpisodeEngine(Engine):
    """The gated engine as one episode sees it: every request carries the episode's priority."""

    def __init__(self, gate: GatedEngine, priority: int):
        self.gate, self.priority = gate, priority

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None
    ) -> GenerateResult:
        return await self.gate.generate(input_ids, sampling, rid=rid, priority=self.priority)

    async def model_info(self) -> dict[str, Any]:
        return await self.gate.model_info()

"""``single``: n samples of one policy per prompt; the samples of a prompt form one GRPO group.

Rows: agent ``policy``, round 0, index 0..n-1; reward = the scorer's (the task's verifier, or ``--reward``)
on the response (:meth:`AgentSystem.score`).
"""

from __future__ import annotations

import asyncio
import dataclasses

from rollshard.generate.agents.base import AgentSystem, Episode
from rollshard.store.format.schema import Row

AGENT = "policy"


@dataclasses.dataclass(kw_only=True)
class SingleOptions:
    n_samples: int = 4


class Single(AgentSystem):
    name = "single"

    def __init__(self, options: SingleOptions):
        if options.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {options.n_samples}")
        self.options = options

    @property
    def max_parallel_calls(self) -> int:
        return self.options.n_samples

    async def run(self, episode: Episode) -> list[Row]:
        messages = episode.task.messages(episode.prompt)
        calls = await asyncio.gather(*(episode.call(AGENT, 0, i, messages) for i in range(self.options.n_samples)))
        return [episode.row(call) for call in calls if call is not None]

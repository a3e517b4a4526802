"""An agent system: draft, then revise.

    rollshard-generate --engine embedded:MODEL --agents examples/plugins/agents.py:DraftRevise \
        --agent-option revise_prompt="Make it shorter." --out D

Each of ``n_samples`` drafts (round 0, one GRPO group) is shown back to the policy, which
revises it (round 1, another group). Every call goes through ``episode.call`` and every row
through ``episode.row(call)``, so tokens and logprobs are the engine's; ``score`` (inherited
here) scores each row's last turn with the task's verifier or ``--reward``.
"""

import asyncio
import dataclasses

from rollshard.generate.agents import AgentSystem, Episode


class DraftRevise(AgentSystem):
    name = "draft_revise"

    @dataclasses.dataclass(kw_only=True)
    class Options:  # --n-samples sets n_samples; --agent-option KEY=VALUE the others
        n_samples: int = 2
        revise_prompt: str = "Improve your answer. Give only the final answer."

    def __init__(self, options: Options):
        self.options = options

    @property
    def max_parallel_calls(self) -> int:
        return self.options.n_samples

    async def run(self, episode: Episode):
        messages = episode.task.messages(episode.prompt)
        drafts = await asyncio.gather(*(episode.call("drafter", 0, i, messages) for i in range(self.options.n_samples)))
        revisions = await asyncio.gather(*(
            episode.call("reviser", 1, i, messages + [
                {"role": "assistant", "content": draft.last_text},
                {"role": "user", "content": self.options.revise_prompt},
            ])
            for i, draft in enumerate(drafts)
        ))
        return [episode.row(call) for call in drafts + revisions]

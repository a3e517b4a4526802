"""A task: where prompts come from, how one becomes chat messages, and how a response is scored.

A :class:`Task` holds no state between calls; agent systems call :meth:`Task.messages`
to build what an agent sees and :meth:`Task.verify` to score what it wrote.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from rollshard.generate.tasks.verifiers import Verdict


@dataclasses.dataclass(kw_only=True, frozen=True)
class Prompt:
    """One source prompt: its id, what the user asks, and the label the verifier checks against."""

    prompt_id: str
    index: int  # position in the prompt source (0-based); sharding splits on it
    content: str | list[dict[str, str]]  # a problem statement, or ready chat messages
    label: Any = None

    @property
    def problem(self) -> str:
        """The problem statement: the text itself, or the last user message of a chat prompt."""
        if isinstance(self.content, str):
            return self.content
        users = [m["content"] for m in self.content if m.get("role") == "user"]
        return users[-1] if users else self.content[-1]["content"]


@dataclasses.dataclass(kw_only=True, frozen=True)
class Task:
    """Prompts plus a verifier.

    ``template`` turns a problem statement into the user message (``{problem}`` is
    replaced); prompts given as chat messages are sent as they are.
    """

    name: str
    description: str
    verifier: Callable[[str, Any], Verdict]
    template: str = "{problem}"
    system_prompt: str | None = None
    label_required: bool = True
    default_label: Any = None
    prompt_file: str | None = None  # file under rollshard.generate.tasks/data/

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        if not isinstance(prompt.content, str):
            return [dict(m) for m in prompt.content]
        return self.chat(self.template.format(problem=prompt.content))

    def chat(self, user: str) -> list[dict[str, str]]:
        """A conversation of the task's system prompt (if any) and one user message."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": user}]

    def verify(self, text: str, label: Any) -> Verdict:
        return self.verifier(text, self.default_label if label is None else label)

    def default_prompts(self) -> Path:
        """The prompt file shipped with the task."""
        if self.prompt_file is None:
            raise ValueError(f"task {self.name!r} ships no prompt file; pass --prompts")
        return Path(str(resources.files("rollshard.generate.tasks") / "data" / self.prompt_file))

"""A task: where prompts come from, how one becomes chat messages, and how a response is scored.

A :class:`Task` holds no state between calls; agent systems call :meth:`Task.messages`
to build what an agent sees, and the run's scorer calls :meth:`Task.verify` to score what it
wrote (unless ``--reward`` replaces it).

A user task (``--task module:attr`` / ``file.py:attr``) is a :class:`Task` instance, a
subclass of it, or a function returning one (called with no argument). Its verifier takes
``(text, label)`` and returns a :class:`Verdict`, a float, or a dict ``{"reward": ...}``
(rollshard/generate/rewards.py); ``prompts`` names its prompt source (a JSONL/Parquet file,
relative to the task's own file, or a HF dataset), used when ``--prompts`` is not given; a task
with a ``generator`` (:class:`~rollshard.generate.tasks.generated.ProblemGenerator`) draws its own
seeded prompts instead, split into ``train`` and ``eval``.
Override :meth:`Task.messages` for prompts that are not one templated user message.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rollshard.generate.tasks.verifiers import Verdict

if TYPE_CHECKING:
    from rollshard.generate.tasks.generated import ProblemGenerator


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
    verifier: Callable[[str, Any], Verdict | float | dict]
    template: str = "{problem}"
    system_prompt: str | None = None
    label_required: bool = True
    default_label: Any = None
    prompt_file: str | None = None  # file under rollshard.generate.tasks/data/ (built-in tasks)
    generator: ProblemGenerator | None = None  # draws the task's own prompts (tasks/generated.py) instead of a file
    prompts: str | None = None  # a user task's prompt source: a path (relative to its file) or HF dataset name
    plugin: dict[str, Any] | None = None  # where a user task came from (its identity; set when it is loaded)

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """What the agent sees: the templated problem after the system prompt; chat prompts as they are (the
        system prompt first when they have none)."""
        if not isinstance(prompt.content, str):
            messages = [dict(m) for m in prompt.content]
            if self.system_prompt and not any(m.get("role") == "system" for m in messages):
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return messages
        return self.chat(self.template.format(problem=prompt.content))

    def chat(self, user: str) -> list[dict[str, str]]:
        """A conversation of the task's system prompt (if any) and one user message."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": user}]

    def verify(self, text: str, label: Any) -> Verdict | float | dict:
        return self.verifier(text, self.default_label if label is None else label)

    def default_prompts(self) -> Path | str:
        """The task's own prompt source: a user task's ``prompts``, or the file shipped with a built-in one."""
        if self.prompts is not None:
            return self.prompts
        if self.prompt_file is None:
            raise ValueError(f"task {self.name!r} names no prompts of its own; pass --prompts")
        return Path(str(resources.files("rollshard.generate.tasks") / "data" / self.prompt_file))

"""Tasks: prompt sources and verifiers. Built in: ``math``, ``exact``, ``toy``.

* ``math``: math word problems; reward 1 when the final answer (last ``\\boxed{}``, else
  the last number) equals the label after normalization (rules in
  :mod:`rollshard.generate.tasks.verifiers`).
* ``exact``: short-answer questions; reward 1 when the response equals the label up to
  surrounding and repeated whitespace.
* ``toy``: a shaped reward (fraction of digit characters, :mod:`rollshard.generate.tasks.toy`)
  that the tiny CPU model improves on under GRPO within minutes.

Each ships a small prompt file under ``data/`` (written for this project), used when
``--prompts`` is not given.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rollshard.generate import plugins
from rollshard.generate.tasks.base import Prompt, Task
from rollshard.generate.tasks.prompts import PromptSourceError, load_prompts
from rollshard.generate.tasks.toy import DIGITS, toy_verify
from rollshard.generate.tasks.verifiers import Verdict, exact_verify, math_verify

TASKS: dict[str, Task] = {
    "math": Task(
        name="math",
        description="math word problems, final answer checked (boxed or last number)",
        verifier=math_verify,
        template="{problem}\nGive the final answer as \\boxed{{ANSWER}}.",
        prompt_file="math.jsonl",
    ),
    "exact": Task(
        name="exact",
        description="short answers, exact match up to whitespace",
        verifier=exact_verify,
        template="{problem}\nAnswer with the answer only.",
        prompt_file="exact.jsonl",
    ),
    "toy": Task(
        name="toy",
        description="shaped reward: fraction of digit characters in the response",
        verifier=toy_verify,
        label_required=False,
        default_label=DIGITS,
        prompt_file="toy.jsonl",
    ),
}


def get_task(name: str) -> Task:
    """A built-in task by name, or a user task by ``module:attr`` / ``file.py:attr`` (see tasks/base.py)."""
    if plugins.is_spec(name):
        return _plugin_task(name)
    try:
        return TASKS[name]
    except KeyError as e:
        raise ValueError(
            f"unknown task {name!r}; choose one of {', '.join(sorted(TASKS))}, or give your own as module:attr or "
            "path/to/file.py:attr"
        ) from e


def _plugin_task(spec: str) -> Task:
    plugin = plugins.load(spec, what="--task")
    obj = plugin.obj
    if not isinstance(obj, Task) and callable(obj):  # a Task subclass, or a function returning a Task
        try:
            obj = obj()
        except Exception as e:
            raise ValueError(f"--task {spec!r}: calling {getattr(plugin.obj, '__name__', spec)}() raised "
                             f"{type(e).__name__}: {e}") from e
    if not isinstance(obj, Task):
        raise ValueError(
            f"--task {spec!r} is a {type(obj).__name__}, not a Task (from rollshard.generate.tasks import Task)"
        )
    prompts = obj.prompts
    if prompts is not None and plugin.file and not Path(prompts).is_absolute():
        local = Path(plugin.file).parent / prompts
        prompts = str(local) if local.exists() else prompts  # else a HF dataset name
    return dataclasses.replace(obj, prompts=prompts, plugin=plugin.identity)


__all__ = ["TASKS", "Prompt", "PromptSourceError", "Task", "Verdict", "get_task", "load_prompts"]

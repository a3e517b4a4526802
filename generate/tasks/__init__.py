"""Tasks: prompt sources and verifiers. Built in: ``math``, ``exact``, ``toy``, ``arithmetic``, ``countdown``.

* ``math``: math word problems; reward 1 when the final answer (last ``\\boxed{}``, else
  the last number) equals the label after normalization (rules in
  :mod:`rollshard.generate.tasks.verifiers`).
* ``exact``: short-answer questions; reward 1 when the response equals the label up to
  surrounding and repeated whitespace.
* ``toy``: a shaped reward (fraction of digit characters, :mod:`rollshard.generate.tasks.toy`)
  that the tiny CPU model improves on under GRPO within minutes.
* ``arithmetic``: generated two-number problems, ``What is 34 - 41?`` followed by
  ``Give the final answer as \\boxed{ANSWER}.``; reward 1 when the boxed answer (else the last
  number) equals the integer result (:mod:`rollshard.generate.tasks.arithmetic`). Options:
  ``digits`` (of each operand, 1-9, default 2), ``ops`` (from ``+-*``, default ``+-``).
* ``countdown`` (TinyZero's): generated, always solvable problems, ``Using the numbers [19, 36, 55,
  7], create an equation that equals 65.``, the answer asked in ``<answer> </answer>`` tags;
  reward 1 when the expression, parsed with :mod:`ast` over a whitelist (never evaluated as
  code), uses each given number at most once and equals the target exactly
  (:mod:`rollshard.generate.tasks.countdown`). Options: ``min_numbers`` (default 3),
  ``max_numbers`` (4), ``max_number`` (99), ``max_target`` (100).

Each of the first three ships a small prompt file under ``data/`` (written for this project),
used when ``--prompts`` is not given. ``arithmetic`` and ``countdown`` draw their prompts
(:mod:`rollshard.generate.tasks.generated`): ``--split train`` (default) or ``--split eval``, a
held-out split disjoint from every train split, and ``--task-option KEY=VALUE`` for the options
above and ``seed`` (default 0) and ``size`` (problems in the split; default 5000 for train, 500
for eval). The same seed and options always give the same prompts, ids and labels; prompt ids are
``{task}-{split}-{hash of the problem}``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rollshard.generate import plugins
from rollshard.generate.tasks.arithmetic import Arithmetic
from rollshard.generate.tasks.base import Prompt, Task
from rollshard.generate.tasks.countdown import Countdown, countdown_verify
from rollshard.generate.tasks.generated import ProblemGenerator, TaskOptionError, parse_task_options
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
    "arithmetic": Task(
        name="arithmetic",
        description="generated two-number + - * problems, integer answer checked (boxed or last number)",
        verifier=math_verify,
        template="{problem}\nGive the final answer as \\boxed{{ANSWER}}.",
        generator=Arithmetic(),
    ),
    "countdown": Task(
        name="countdown",
        description="generated countdown problems: an expression over the given numbers that reaches the target",
        verifier=countdown_verify,
        template="{problem} You can use +, -, * and /, and each number at most once. Give the final equation in "
        "<answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.",
        generator=Countdown(),
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


__all__ = [
    "TASKS", "Prompt", "ProblemGenerator", "PromptSourceError", "Task", "TaskOptionError", "Verdict", "get_task",
    "load_prompts", "parse_task_options",
]

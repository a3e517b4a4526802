"""Tasks whose problems are generated, not read: seeded, with a train split and a disjoint held-out split.

A :class:`ProblemGenerator` draws one problem at a time; :meth:`ProblemGenerator.prompts` turns draws
into the prompts of one split:

* **The split of a problem is a function of the problem alone.** Each problem has a canonical key
  (``34-41``; ``34+41`` for both orders of a sum) and belongs to the ``eval`` split when the
  blake2b hash of ``{task}:{key}`` is 0 modulo :data:`EVAL_MODULUS`, else to ``train``. About a tenth
  of all problems are held out, whatever the seed or size: no ``eval`` problem is ever in a ``train``
  split, also one drawn with another seed.
* **The seed picks which problems, in which order.** Draws come from ``random.Random("{task}:{seed}:
  {split}")``; a draw of the other split, or of a problem already drawn, is skipped. So a larger size
  extends a smaller one (``size=100`` is the first 100 of ``size=5000``, as ``--limit`` takes them).
* **A prompt id names the problem and the split**: ``{task}-{split}-{16 hex digits of the hash}``,
  the same under every seed and size. A problem is rendered from its key alone (an order to show
  is derived from the key's hash), so the same id always has the same prompt and label.

Options (``--task-option KEY=VALUE``) are each generator's own plus ``seed`` (default 0) and ``size``
(the number of problems of the split: :data:`DEFAULT_SIZES`). An unknown option, a bad value or a
size larger than the split holds is a one-line :class:`TaskOptionError`.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import random
from typing import Any, Callable, Mapping

from rollshard.generate.tasks.base import Prompt

SPLITS = ("train", "eval")
DEFAULT_SIZES = {"train": 5000, "eval": 500}
EVAL_MODULUS = 10  # 1 problem in 10 is held out
MAX_DRAWS_PER_PROBLEM = 50  # then the split is taken as exhausted (the options allow fewer problems than asked)
MAX_SIZE = 100_000  # bounds generation time (MAX_DRAWS_PER_PROBLEM draws a problem at worst); far above the defaults


class TaskOptionError(ValueError):
    """A task option or split that the task does not have or cannot satisfy; the message names it."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class Option:
    """A task option: its default, how its text becomes a value (ValueError if it cannot), what is allowed."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    allowed: str  # completes "must be ...", e.g. "an integer from 1 to 9"


def int_option(name: str, default: int | None, low: int, high: int) -> Option:
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError(text)
        return value

    return Option(name=name, default=default, parse=parse, allowed=f"an integer from {low} to {high}")


COMMON_OPTIONS = (
    int_option("seed", 0, 0, 2**63 - 1),
    int_option("size", None, 1, MAX_SIZE),  # None: DEFAULT_SIZES of the split
)


@dataclasses.dataclass(kw_only=True, frozen=True)
class Problem:
    """One generated problem: its canonical key, statement and label, and a reference solution."""

    key: str  # equal keys are the same problem (deduplication, split and id)
    content: str  # the problem statement; the task's template turns it into the user message
    label: Any  # what the verifier checks against (stored in the rows)
    solution: str  # an answer the verifier accepts (not part of the prompt or the label)


class ProblemGenerator(abc.ABC):
    """How a task draws its problems; :meth:`prompts` does the splitting, seeding and numbering."""

    name: str  # the task's name: part of every key's hash, seed stream and prompt id
    options: tuple[Option, ...] = ()  # the generator's own; seed and size are added

    @abc.abstractmethod
    def draw(self, rng: random.Random, options: Mapping[str, Any]) -> Problem | None:
        """A random problem, or None when this draw is rejected (it counts toward the draw budget)."""

    def check(self, options: Mapping[str, Any]) -> None:
        """Raise :class:`TaskOptionError` for options that are valid one by one but not together."""

    def resolve(self, given: Mapping[str, str], split: str) -> dict[str, Any]:
        """Every option's value (defaults filled in) from the ``KEY=VALUE`` texts given."""
        if split not in SPLITS:
            raise TaskOptionError(f"--split {split}: task {self.name} has the splits {' and '.join(SPLITS)}")
        known = {o.name: o for o in self.options + COMMON_OPTIONS}
        for key in given:
            if key not in known:
                names = ", ".join(sorted(known))
                raise TaskOptionError(f"task {self.name} has no option {key!r}; its options: {names}")
        values = {}
        for name, option in known.items():
            if name not in given:
                values[name] = option.default
                continue
            try:
                values[name] = option.parse(given[name])
            except ValueError as e:
                raise TaskOptionError(
                    f"task {self.name}: option {name}={given[name]!r} must be {option.allowed}"
                ) from e
        if values["size"] is None:
            values["size"] = DEFAULT_SIZES[split]
        self.check(values)
        return values

    def problems(self, split: str, options: Mapping[str, Any]) -> list[Problem]:
        """The split's problems for resolved ``options``, in draw order."""
        rng = random.Random(f"{self.name}:{options['seed']}:{split}")
        size = options["size"]
        found: dict[str, Problem] = {}
        draws = 0
        while len(found) < size and draws < MAX_DRAWS_PER_PROBLEM * size:
            draws += 1
            problem = self.draw(rng, options)
            if problem is not None and problem.key not in found and split_of(self.name, problem.key) == split:
                found[problem.key] = problem
        if len(found) < size:
            shown = ", ".join(f"{o.name}={options[o.name]}" for o in self.options)
            raise TaskOptionError(
                f"task {self.name}: only {len(found)} distinct {split} problems in {draws} draws ({shown}), "
                f"fewer than size={size}; pass --task-option size={len(found)} or less, or options allowing more "
                "problems"
            )
        return list(found.values())

    def prompts(self, split: str, options: Mapping[str, Any]) -> list[Prompt]:
        return [
            Prompt(prompt_id=prompt_id(self.name, split, p.key), index=i, content=p.content, label=p.label)
            for i, p in enumerate(self.problems(split, options))
        ]


def key_hash(task: str, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{task}:{key}".encode(), digest_size=8).digest(), "big")


def split_of(task: str, key: str) -> str:
    return "eval" if key_hash(task, key) % EVAL_MODULUS == 0 else "train"


def prompt_id(task: str, split: str, key: str) -> str:
    return f"{task}-{split}-{key_hash(task, key):016x}"


def parse_task_options(items: list[str]) -> dict[str, str]:
    """``["digits=3", "ops=+-*"]`` -> ``{"digits": "3", "ops": "+-*"}``; one line for a malformed or repeated one."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise TaskOptionError(f"--task-option {item!r}: expected KEY=VALUE, e.g. --task-option size=100")
        if key in out:
            raise TaskOptionError(f"--task-option {key} is given twice ({out[key]!r} and {value!r}); give it once")
        out[key] = value
    return out

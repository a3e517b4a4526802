"""The ``countdown`` task (TinyZero's): reach a target with + - * / over given numbers, each used at most once.

Problems: ``min_numbers`` to ``max_numbers`` numbers from 1 to ``max_number``; the target is built
from all of them (two at a time, in a random order, with a random operation whose result stays a
positive integer: ``a - b`` only for ``a > b``, ``a / b`` only when ``b`` divides ``a``; one whose
result is at most ``max_target`` when there is one), so every problem is solvable; draws whose
target still exceeds ``max_target`` are rejected. The key is the
sorted numbers and the target (``7,19,36,55->65``); the numbers are shown in an order derived from
it. The label is ``{"numbers": [...], "target": N}``.

Verifier (:func:`countdown_verify`), reward 1.0 or 0.0:

* the expression is the content of the last ``<answer>...</answer>`` (as TinyZero asks), else of the
  last ``\\boxed{}``; ``×``, ``\\times``, ``÷``, ``\\div`` read as ``*`` and ``/``; a trailing ``= N`` is
  dropped (the value of the expression is what counts);
* it may hold only integers, ``+ - * /``, parentheses and spaces (TinyZero's character rule), at most
  :data:`MAX_EXPRESSION_CHARS`; it is parsed with :mod:`ast` and evaluated node by node over a
  whitelist (binary ``+ - * /`` and integer constants; no unary minus, ``//`` or ``**``), never by
  ``eval``; division is exact (:class:`fractions.Fraction`), division by zero scores 0;
* the integers it uses must be a sub-multiset of the given numbers (each at most once, as often as
  given; TinyZero requires every number exactly once), and its value must equal the target.

No partial credit (TinyZero gives 0.1 for a well-formed wrong answer).
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any, Mapping

from rollshard.generate.tasks.generated import Problem, ProblemGenerator, TaskOptionError, int_option
from rollshard.generate.tasks.verifiers import Verdict, last_boxed

MAX_EXPRESSION_CHARS = 200  # an answer is a few numbers and operators; a bound keeps parsing and values small
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ALLOWED_CHARS = re.compile(r"[\d+\-*/()\s]+")
TRAILING_RESULT = re.compile(r"=\s*-?\d+\s*$")
SYMBOLS = {"×": "*", "\\times": "*", "÷": "/", "\\div": "/", "\\cdot": "*"}
BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class Countdown(ProblemGenerator):
    name = "countdown"
    options = (
        int_option("min_numbers", 3, 2, 6),
        int_option("max_numbers", 4, 2, 6),
        int_option("max_number", 99, 1, 10_000),
        int_option("max_target", 100, 1, 1_000_000),
    )

    def check(self, options: Mapping[str, Any]) -> None:
        if options["min_numbers"] > options["max_numbers"]:
            raise TaskOptionError(
                f"task countdown: min_numbers={options['min_numbers']} is more than max_numbers="
                f"{options['max_numbers']}; give min_numbers <= max_numbers"
            )

    def draw(self, rng: random.Random, options: Mapping[str, Any]) -> Problem | None:
        count = rng.randint(options["min_numbers"], options["max_numbers"])
        numbers = [rng.randint(1, options["max_number"]) for _ in range(count)]
        pool = [(n, str(n)) for n in numbers]  # (value, expression); values stay positive integers
        while len(pool) > 1:
            (a, ea), (b, eb) = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
            choices = [("+", a + b), ("*", a * b)]
            if a > b:
                choices.append(("-", a - b))
            if a % b == 0:
                choices.append(("/", a // b))
            in_range = [c for c in choices if c[1] <= options["max_target"]]  # most draws then give a target
            op, value = rng.choice(in_range or choices)
            pool.append((value, f"({ea} {op} {eb})"))
        target, solution = pool[0]
        if not 1 <= target <= options["max_target"]:
            return None
        return problem(numbers, target, solution=f"<answer>{solution[1:-1]}</answer>")


def problem(numbers: list[int], target: int, *, solution: str) -> Problem:
    ordered = sorted(numbers)
    key = f"{','.join(map(str, ordered))}->{target}"
    random.Random(key).shuffle(ordered)
    return Problem(
        key=key,
        content=f"Using the numbers {ordered}, create an equation that equals {target}.",
        label={"numbers": sorted(numbers), "target": target},
        solution=solution,
    )


class ExpressionError(ValueError):
    """The answer is not an expression of allowed integers and operations; the message says why."""


def extract_expression(text: str) -> tuple[str | None, str | None]:
    """(expression, where it came from: ``"answer_tag"`` | ``"boxed"`` | None)."""
    tags = ANSWER_RE.findall(text)
    if tags:
        return tags[-1].strip(), "answer_tag"
    boxed = last_boxed(text)
    return (boxed.strip(), "boxed") if boxed is not None else (None, None)


def evaluate(expression: str, numbers: list[int]) -> tuple[Fraction, list[int]]:
    """(value, integers used) of an answer over the given numbers; :class:`ExpressionError` if it is not allowed."""
    for symbol, plain in SYMBOLS.items():
        expression = expression.replace(symbol, plain)
    expression = TRAILING_RESULT.sub("", expression).strip()
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    if not ALLOWED_CHARS.fullmatch(expression):
        raise ExpressionError("only integers, + - * /, parentheses and spaces are allowed")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ExpressionError(f"not an arithmetic expression ({e.msg})") from e
    for node in ast.walk(tree.body):
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPS or isinstance(node, ast.operator):
            continue  # an allowed operation (its operator node is checked with it)
        if not (isinstance(node, ast.Constant) and type(node.value) is int):
            what = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node).__name__
            raise ExpressionError(f"{what} is not allowed: only integers and binary + - * /")
    used = sorted(node.value for node in ast.walk(tree) if isinstance(node, ast.Constant))
    missing = Counter(used) - Counter(numbers)
    if missing:
        raise ExpressionError(f"uses {sorted(missing.elements())} beyond the given numbers {sorted(numbers)}")
    try:
        return _value(tree.body), used
    except ZeroDivisionError as e:
        raise ExpressionError("division by zero") from e


def _value(node: ast.AST) -> Fraction:
    """The exact value of a checked tree: binary + - * / over integer constants."""
    if isinstance(node, ast.BinOp):
        return BINARY_OPS[type(node.op)](_value(node.left), _value(node.right))
    return Fraction(node.value)


def countdown_verify(text: str, label: Any) -> Verdict:
    target, numbers = (label.get("target"), label.get("numbers")) if isinstance(label, dict) else (None, None)
    if not isinstance(target, int) or not isinstance(numbers, list):
        raise ValueError(f"a countdown label is {{'numbers': [int, ...], 'target': int}}, not {label!r}")
    expression, source = extract_expression(text)
    detail: dict[str, Any] = {"source": source, "target": target, "value": None, "error": None}
    if expression is None:
        detail["error"] = "no <answer> tags or \\boxed{}"
        return Verdict(reward=0.0, correct=False, answer=None, detail=detail)
    try:
        value, used = evaluate(expression, numbers)
    except ExpressionError as e:
        return Verdict(reward=0.0, correct=False, answer=expression, detail={**detail, "error": str(e)})
    correct = value == target
    return Verdict(
        reward=1.0 if correct else 0.0,
        correct=correct,
        answer=expression,
        detail={**detail, "value": str(value), "used": used},
    )

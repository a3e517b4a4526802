"""The ``arithmetic`` task: two-number problems such as ``What is 34 - 41?``, answer checked exactly.

Problems: two operands of exactly ``digits`` digits (``digits=1``: 0 to 9) and one operator drawn
from ``ops`` (``+``, ``-``, ``*``, shown as ``×``). The label is the integer result, negative for a
difference that goes below zero. ``a + b`` and ``b + a`` (also ``×``) are one problem (key
``min+max``), shown in an order derived from the key, so a held-out sum is not in train the other
way round.

Verifier: :func:`~rollshard.generate.tasks.verifiers.math_verify` with the integer label: the last
``\\boxed{}`` of the response, else its last number (``-7`` parses as minus seven), compared by value
(``\\boxed{-7}``, ``The answer is -7.`` and ``-7.0`` all match a label of -7).
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from rollshard.generate.tasks.generated import Option, Problem, ProblemGenerator, int_option

OPERATORS = "+-*"
SHOWN = {"+": "+", "-": "-", "*": "×"}
COMMUTATIVE = "+*"


def _ops(text: str) -> str:
    if not text or any(c not in OPERATORS for c in text) or len(set(text)) != len(text):
        raise ValueError(text)
    return "".join(c for c in OPERATORS if c in text)  # canonical order: "-+" and "+-" are the same option


class Arithmetic(ProblemGenerator):
    name = "arithmetic"
    options = (
        int_option("digits", 2, 1, 9),
        Option(name="ops", default="+-", parse=_ops, allowed="one or more of + - * without repeats, e.g. +-*"),
    )

    def draw(self, rng: random.Random, options: Mapping[str, Any]) -> Problem:
        digits = options["digits"]
        low, high = (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(options["ops"])
        return problem(a, op, b)


def problem(a: int, op: str, b: int) -> Problem:
    """The problem ``a op b``; for ``+`` and ``*`` the key sorts the operands and the shown order comes from it."""
    if op in COMMUTATIVE:
        a, b = sorted((a, b))
    key = f"{a}{op}{b}"
    if op in COMMUTATIVE and random.Random(key).random() < 0.5:
        a, b = b, a
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return Problem(key=key, content=f"What is {a} {SHOWN[op]} {b}?", label=value, solution=f"\\boxed{{{value}}}")

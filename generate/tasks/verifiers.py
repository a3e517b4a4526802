"""Answer extraction and reward rules shared by the built-in tasks; pure functions of strings.

Math final answer (:func:`math_verify`): the answer is the content of the last
``\\boxed{...}`` (or ``\\fbox{...}``) in the response, braces balanced; without one, the
last number (integer, decimal, ``a/b`` or ``\\frac{a}{b}``) in the response. Answer and
label are normalized before comparison:

* LaTeX wrappers and noise are dropped: ``$``, ``\\left``/``\\right``, ``\\!``, ``\\,``,
  ``\\text{...}`` / ``\\mathrm{...}`` (kept: their content), ``^\\circ``, ``\\%``, a trailing
  period, surrounding whitespace;
* numbers compare by value: thousands separators are removed (``1,000`` -> 1000) and
  integers, decimals, ``a/b`` and ``\\frac{a}{b}`` (also ``\\dfrac``, ``\\tfrac``) become
  exact fractions, so ``0.5 == 1/2 == \\frac{1}{2}`` and ``7.0 == 7`` (no float rounding);
* anything else compares as the whitespace-free, lower-cased string (``x = 3`` is not
  reduced to ``3``: write the label the way the answer is asked for).

Reward 1.0 when equal, 0.0 otherwise, including when no answer was found.

Exact match (:func:`exact_verify`): the response with surrounding whitespace stripped
and inner whitespace runs collapsed to one space equals the label under the same
normalization; case-sensitive, so the prompt has to state the expected form.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any

BOXED_COMMANDS = ("\\boxed", "\\fbox")
NUMBER_RE = re.compile(
    r"-?\\[dt]?frac\s*\{\s*-?\d+\s*\}\s*\{\s*-?\d+\s*\}"  # \frac{a}{b} is one number, not two
    r"|-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?"
)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%", "\\displaystyle")


@dataclasses.dataclass(kw_only=True, frozen=True)
class Verdict:
    """A verifier's judgment of one response."""

    reward: float
    correct: bool
    answer: str | None  # what the verifier read as the answer (None: nothing found)
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"reward": self.reward, "correct": self.correct, "answer": self.answer, **self.detail}


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` with balanced braces, or None."""
    start = max(text.rfind(cmd + "{") for cmd in BOXED_COMMANDS)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None  # unclosed: the response was cut inside the box


def last_number(text: str) -> str | None:
    matches = NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def extract_math_answer(text: str) -> tuple[str | None, str | None]:
    """(answer, where it came from: ``"boxed"`` | ``"last_number"`` | None)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    number = last_number(text)
    return (number, "last_number") if number is not None else (None, None)


def _to_fraction(s: str) -> Fraction | None:
    s = s.replace(",", "").replace(" ", "")
    if s.startswith("+"):
        s = s[1:]
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _frac_to_slash(m: re.Match) -> str:
    num, den = m.group(1).strip(), m.group(2).strip()
    plain = re.compile(r"-?[\d.,]+")
    return f"{num}/{den}" if plain.fullmatch(num) and plain.fullmatch(den) else f"({num})/({den})"


def normalize_math(answer: str) -> str:
    """Canonical string of a math answer; equal strings mean equal answers (rules in the docstring)."""
    s = answer.strip()
    s = _TEXT_RE.sub(r"\1", s)
    for noise in _NOISE:
        s = s.replace(noise, "")
    s = _FRAC_RE.sub(_frac_to_slash, s)
    s = s.strip().rstrip(".").strip()
    bare = s.replace(" ", "")
    if re.fullmatch(r"[-+]?[\d.,]+(/[-+]?[\d.,]+)?", bare):
        value = _to_fraction(bare)
        if value is not None:
            return str(value)  # Fraction prints "7" or "3/2"
    return re.sub(r"\s+", "", s).lower()


def math_verify(text: str, label: Any) -> Verdict:
    answer, source = extract_math_answer(text)
    expected = normalize_math(str(label))
    if answer is None:
        return Verdict(reward=0.0, correct=False, answer=None, detail={"source": None, "expected": expected})
    got = normalize_math(answer)
    correct = got == expected
    return Verdict(
        reward=1.0 if correct else 0.0,
        correct=correct,
        answer=answer,
        detail={"source": source, "normalized": got, "expected": expected},
    )


def normalize_exact(text: str) -> str:
    return " ".join(text.split())


def exact_verify(text: str, label: Any) -> Verdict:
    got, expected = normalize_exact(text), normalize_exact(str(label))
    correct = got == expected
    return Verdict(
        reward=1.0 if correct else 0.0,
        correct=correct,
        answer=got or None,
        detail={"expected": expected},
    )

"""The toy task: a shaped reward a tiny random model can climb under GRPO in minutes on CPU.

Reward of a response (``label`` is the target character set, ``"0123456789"`` by default)::

    r = (number of non-whitespace characters of the response that are in the target set)
        / (number of non-whitespace characters of the response)

and ``r = 0`` for an empty (or all-whitespace) response. So ``r`` is in ``[0, 1]``:
``"12ab"`` scores 0.5, ``"2024"`` scores 1.0. A response counts as correct (for the
multi-agent selector's episode weighting) when ``r >= TOY_CORRECT_THRESHOLD``.

Why it is learnable: the reward is a per-token property (a token either spells digits or
not), so raising it only needs the policy to move probability mass toward the ~390 of
the 1024 tokens of the tiny tokenizer that contain digits -- a shift of the output
layer that a few dozen GRPO steps make, unlike a correctness reward, which a random
model never earns and so never learns from. Samples of one prompt differ a lot in
``r`` (a random policy mixes digit and letter tokens), so GRPO groups carry signal
from step 0.
"""

from __future__ import annotations

from typing import Any

from rollshard.generate.tasks.verifiers import Verdict

DIGITS = "0123456789"
TOY_CORRECT_THRESHOLD = 0.5  # half the characters on target: the selector "picked right"


def target_fraction(text: str, targets: str) -> tuple[int, int]:
    """(characters in the target set, non-whitespace characters) of ``text``."""
    chars = [c for c in text if not c.isspace()]
    return sum(c in targets for c in chars), len(chars)


def toy_verify(text: str, label: Any) -> Verdict:
    targets = str(label) if label else DIGITS
    hits, total = target_fraction(text, targets)
    reward = hits / total if total else 0.0
    return Verdict(
        reward=reward,
        correct=reward >= TOY_CORRECT_THRESHOLD,
        answer=text.strip() or None,
        detail={"hits": hits, "chars": total},
    )

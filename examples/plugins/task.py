"""A task: how many letters does a word have?

    rollshard-generate --engine embedded:MODEL --task examples/plugins/task.py:LETTERS --out D

A ``Task`` names its prompts (a JSONL file next to this one; ``--prompts`` overrides it),
how a prompt becomes the user message, and a verifier ``(response, label) -> reward``.
"""

import re

from rollshard.generate.tasks import Task


def count_verifier(response: str, label) -> dict:
    numbers = re.findall(r"-?\d+", response)
    if not numbers:
        return {"reward": 0.0, "correct": False, "answer": None}
    answer = int(numbers[-1])
    return {"reward": 1.0 / (1 + abs(answer - int(label))), "correct": answer == int(label), "answer": str(answer)}


LETTERS = Task(
    name="letters",
    description="count the letters of a word; reward 1 / (1 + |answer - count|)",
    verifier=count_verifier,
    template="How many letters are in the word {problem!r}? Answer with a number.",
    prompts="words.jsonl",
)

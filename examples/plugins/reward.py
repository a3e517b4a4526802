"""A reward function: digits, briefly.

    rollshard-generate --engine embedded:MODEL --task toy --reward examples/plugins/reward.py:digits_briefly --out D
    rollshard-generate rescore D --reward examples/plugins/reward.py:digits_briefly --out D-rescored

It gets one ``rollshard.generate.rewards.Sample`` (the row: prompt, response text and tokens,
label, metadata) and returns a float or a dict with ``"reward"``; the other keys are kept in
the row's ``metadata.verdict``. It may be ``async def`` (a call to a judge model, say).
"""

from rollshard.generate.rewards import Sample

TARGET_TOKENS = 8  # responses longer than this lose 0.01 per extra token


def digits_briefly(sample: Sample) -> dict:
    chars = [c for c in sample.response if not c.isspace()]
    digits = sum(c.isdigit() for c in chars)
    fraction = digits / len(chars) if chars else 0.0
    penalty = 0.01 * max(0, len(sample.response_tokens) - TARGET_TOKENS)
    return {"reward": fraction - penalty, "digits": digits, "penalty": penalty}

"""What one round of training did to the policy on the very rows it trained on.

The rise of the reward on fresh samples is a random variable wherever sampling cannot be seeded (SGLang's CPU
server), so the closed-loop tests check the update itself: on the fixed rows of the round, each sequence's
logprob (summed over its response tokens, at the row's temperature, teacher-forced in fp32) under the trained
checkpoint minus under the model that generated them. GRPO must move the best response of each group up and the
worst down; groups whose rewards are all equal carry no advantage and are left out.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import torch


@torch.no_grad()
def sequence_logprobs(model_dir: Path, rows: pl.DataFrame) -> list[float]:
    """Summed response logprob of every row under the model of ``model_dir`` (log softmax(logits / temperature))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for prompt, response, temp in zip(rows["prompt_tokens"], rows["response_tokens"], rows["temperature"]):
        ids = torch.tensor([*prompt, *response])  # [L]
        logits = model(ids[None]).logits[0, len(prompt) - 1 : -1].float() / temp  # [R, V] predicts the response
        target = torch.tensor(list(response))[:, None]  # [R, 1]
        out.append(float(torch.log_softmax(logits, -1).gather(-1, target).sum()))
    return out


def logprob_change(base: Path, trained: Path, rows: pl.DataFrame) -> dict[str, float]:
    """Mean change (nats) of the sequence logprob of each group's best and worst rows, groups with a spread only."""
    change = [t - b for b, t in zip(sequence_logprobs(base, rows), sequence_logprobs(trained, rows))]
    d = (
        pl.DataFrame({"group": rows["group_id"], "reward": rows["reward"], "change": change})
        .with_columns(
            best=pl.col("reward") == pl.col("reward").max().over("group"),
            worst=pl.col("reward") == pl.col("reward").min().over("group"),
            spread=pl.col("reward").max().over("group") > pl.col("reward").min().over("group"),
        )
        .filter("spread")
    )
    return {
        "best": float(d.filter("best")["change"].mean()),
        "worst": float(d.filter("worst")["change"].mean()),
        "groups": d["group"].n_unique(),
    }

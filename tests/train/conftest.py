"""Fixtures of the trainer tests: a small rollout dataset sampled from the tiny model itself.

Rows are sampled with ``transformers`` ``generate`` (KV cache, as an engine decodes)
and their logprobs are ``log_softmax(raw logits / T)`` of the sampled token, SGLang's
definition, so the trainer's recomputation with unchanged weights must agree with them
to fp32 rounding. The dataset mixes what the trainer must handle: two temperatures,
groups of uneven size, a zero-variance group, and tool/environment tokens (mask 0,
logprob 0) inside a response. Its writer config records what rollshard-generate records
for the trainer's defaults (``agents``, ``sampling.max_new_tokens``).

:func:`write_rows` writes groups of given rewards with fixed tokens, for tests that need
exact group shapes (one-row groups, zero variance) rather than a model's samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollshard.store.format.schema import Row, Status
from rollshard.store.io.writer import ShardWriter

# The tiny model's ops are far too small to gain from intra-op threads; on a shared 2-core
# machine two spinning OpenMP threads per process made a step 20x slower. Subprocesses
# started by these tests inherit OMP_NUM_THREADS.
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def single_thread(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for k, v in SINGLE_THREAD_ENV.items():
        monkeypatch.setenv(k, v)
    yield
    torch.set_num_threads(threads)


PROMPTS = [
    "Question: what is two plus two? Answer:",
    "Solve the problem step by step.",
    "The quick brown fox",
    "Give the final answer.",
    "Select the best answer among the candidates.",
    "Let us think about this problem carefully.",
    "Rewrite the solution so that it is clear.",
    "A small model learns to add numbers.",
]


def even_token_reward(tokens: list[int]) -> float:
    """Fraction of response tokens with an even id: a per-token property, so a policy can learn it."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


@torch.no_grad()
def sample_group(model, tokenizer, prompt: str, n: int, *, temperature: float, max_new_tokens: int, seed: int):
    """``n`` samples of one prompt: (prompt ids, [(response ids, logprobs)])."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    torch.manual_seed(seed)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = model.generate(
        torch.tensor([ids] * n),
        attention_mask=torch.ones(n, len(ids), dtype=torch.long),
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        min_new_tokens=2,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    logits = torch.stack(out.logits, dim=1).float()  # [n, steps, V] raw logits
    logp = torch.log_softmax(logits / temperature, dim=-1)
    rows = []
    for i in range(n):
        resp, lps = [], []
        for s, tok in enumerate(out.sequences[i, len(ids) :].tolist()):
            resp.append(tok)
            lps.append(float(logp[i, s, tok]))
            if tok in eos:
                break
        rows.append((resp, lps))
    return ids, rows


MAX_NEW_TOKENS = 10


def generation_config(model_path: Path, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """The parts of rollshard-generate's run config the trainer reads."""
    return {"model": str(model_path), "agents": {"name": "single", "n_samples": 4},
            "sampling": {"max_new_tokens": max_new_tokens}}


def write_dataset(model_path: Path, out: Path, *, groups: int = 8, group_size: int = 4, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    with ShardWriter(out, writer_id="test", config=generation_config(model_path)) as w:
        for g in range(groups):
            temperature = 0.7 if g % 2 else 1.0
            size = group_size + (1 if g % 3 == 0 else 0)  # uneven groups
            prompt_ids, samples = sample_group(
                model, tok, PROMPTS[g % len(PROMPTS)], size, temperature=temperature, max_new_tokens=MAX_NEW_TOKENS, seed=seed + g
            )
            rows = []
            for i, (resp, lps) in enumerate(samples):
                mask = [1] * len(resp)
                if g == 1 and len(resp) >= 5:  # an environment span inside the response: mask 0, logprob 0
                    for k in (2, 3):
                        mask[k], lps[k] = 0, 0.0
                reward = 0.5 if g == 2 else even_token_reward(resp)  # group 2: zero variance
                rows.append(
                    Row(
                        sample_id=f"p{g}-{i}", prompt_id=f"p{g}", group_id=f"p{g}/policy/0", agent="policy", round=0,
                        prompt_tokens=prompt_ids, response_tokens=resp, rollout_logprobs=lps, loss_mask=mask,
                        reward=reward, status=Status.COMPLETED, finish_reason="stop", weight_version="0",
                        temperature=temperature, top_p=1.0, top_k=-1,
                    )
                )
            w.write_group(rows)
    return out


def write_rows(
    out: Path, group_rewards: list[list[float]], *, config: dict | None = None, response_len: int | list[int] = 4
) -> Path:
    """One group per entry of ``group_rewards`` (its rows' rewards), in that order, with ``response_len`` tokens per
    row (one length, or one per group); tokens and logprobs fixed."""
    lengths = response_len if isinstance(response_len, list) else [response_len] * len(group_rewards)
    with ShardWriter(out, writer_id="test", config=config if config is not None else {}) as w:
        for g, (rewards, n) in enumerate(zip(group_rewards, lengths)):
            w.write_group([
                Row(
                    sample_id=f"p{g}-{i}", prompt_id=f"p{g}", group_id=f"p{g}/policy/0", agent="policy", round=0,
                    prompt_tokens=[5 + g, 6, 7], response_tokens=[(11 * i + k + g) % 1000 + 3 for k in range(n)],
                    rollout_logprobs=[-1.0] * n, loss_mask=[1] * n, reward=r,
                    status=Status.COMPLETED, finish_reason="stop", weight_version="0", temperature=1.0, top_p=1.0,
                    top_k=-1,
                )
                for i, r in enumerate(rewards)
            ])
    return out


@pytest.fixture(scope="session")
def tiny_dataset(tiny_gpt2, tmp_path_factory) -> Path:
    """8 groups (4-5 rows, up to 10 response tokens) sampled from ``tiny_gpt2``."""
    return write_dataset(tiny_gpt2, tmp_path_factory.mktemp("data") / "tiny-rollouts")

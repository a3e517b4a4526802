"""The sampler draws in vocabulary order, so a seeded request's tokens do not depend on the batch it ran in."""

from __future__ import annotations

import asyncio
import random

import torch

from rollshard.generate.engines import SamplingParams
from rollshard.generate.engines.embedded import EmbeddedEngine
from rollshard.generate.engines.sampler import sample_tokens

TOL = 1e-5  # fp32 logprobs of one token under two batch compositions; measured ~1e-6


def test_near_equal_probabilities_swapped_by_rounding_keep_the_token():
    # Two batch compositions round the same row differently: tokens 0 and 1 trade a 1e-6 of probability.
    #   a = [.25 + d, .25, .5 - d],  b = [.25, .25 + d, .5 - d]
    # Vocabulary-order CDF: a [.25+d, .5, 1], b [.25, .5+d, 1]; u .1 -> 0, .3 -> 1, .6 -> 2, .9 -> 2 in both.
    # (Sorted order puts token 2 first, then 0, 1 in a but 1, 0 in b: u .6 and .9 would pick 0/1 vs 1/0.)
    d = 1e-6
    a = torch.log(torch.tensor([[0.25 + d, 0.25, 0.5 - d]])).repeat(4, 1)
    b = torch.log(torch.tensor([[0.25, 0.25 + d, 0.5 - d]])).repeat(4, 1)
    uniform = torch.tensor([0.1, 0.3, 0.6, 0.9], dtype=torch.float64)
    args = (torch.ones(4), torch.ones(4), torch.full((4,), -1), uniform)
    tokens_a, _ = sample_tokens(a, *args)
    tokens_b, _ = sample_tokens(b, *args)
    assert tokens_a.tolist() == tokens_b.tolist() == [0, 1, 2, 2]


def test_a_row_without_truncation_keeps_every_token_in_any_batch():
    # SGLang's top-p rule drops a token whose preceding sorted mass exceeds top_p; at top_p 1 that is only
    # float32 rounding (the sorted cumsum of 151,936 probabilities passes 1 before its tail). Such a row keeps
    # every token, whether its batch skips the sort (alone) or sorts for another row's top-p.
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 151936, generator=g) * 2  # [1, V]
    probs = torch.softmax(row, dim=-1)[0]  # [V]
    sorted_p, order = probs.sort(descending=True)
    rounded_away = order[(sorted_p.cumsum(0) - sorted_p) > 1.0]  # tokens the rule would drop at top_p 1
    assert len(rounded_away) > 0
    j = int(rounded_away.max())
    cum = probs.double().cumsum(0)
    uniform = ((cum[j] - probs[j].double() / 2) / cum[-1]).reshape(1)  # the middle of token j's interval
    alone, _ = sample_tokens(row, torch.ones(1), torch.ones(1), torch.full((1,), -1), uniform)
    other = torch.randn(1, 151936, generator=g)
    batched, _ = sample_tokens(
        torch.cat([row, other]), torch.ones(2), torch.tensor([1.0, 0.9]), torch.full((2,), -1), uniform.repeat(2)
    )
    assert alone.tolist() == [j] and batched[0].item() == j


N_REQUESTS, NEW_TOKENS = 256, 32
# (max_batch_size, submission order reversed). Batch 1 runs every row alone with no padding: the
# composition a regenerated row meets on resume. The old sorted-order sampler changed 3 of the 256
# rows between batch 1 and batch 16 here.
COMPOSITIONS = [(16, False), (1, False), (8, True)]


def _requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(0)
    out = []
    for i in range(N_REQUESTS):
        prompt = [rng.randrange(3, 1024) for _ in range(rng.randint(2, 40))]
        # No top-k/top-p: a rounding difference at a truncation boundary can change the kept set (see the
        # sampler's docstring); this test is about the draw.
        out.append((prompt, SamplingParams(max_new_tokens=NEW_TOKENS, sampling_seed=1000 + i, stop_token_ids=[])))
    return out


def _generate(model, requests, max_batch_size: int, reverse: bool):
    order = list(range(len(requests)))[:: -1 if reverse else 1]

    async def go():
        async with EmbeddedEngine(model, max_batch_size=max_batch_size) as eng:
            eng.eos_ids = []  # every row runs its full length: more draws compared
            results = await asyncio.gather(*(eng.generate(*requests[i]) for i in order))
        return dict(zip(order, results))

    by_index = asyncio.run(go())
    return [by_index[i] for i in range(len(requests))]


def test_seeded_requests_give_the_same_tokens_at_any_batch_size(tiny_qwen3):
    requests = _requests()
    runs = [_generate(tiny_qwen3, requests, bs, rev) for bs, rev in COMPOSITIONS]
    base = runs[0]
    for (bs, rev), run in zip(COMPOSITIONS[1:], runs[1:]):
        differing = [i for i, (x, y) in enumerate(zip(base, run)) if x.output_ids != y.output_ids]
        assert differing == [], f"max_batch_size {bs} (reversed {rev}) changed the tokens of rows {differing}"
        worst = max(abs(p - q) for x, y in zip(base, run) for p, q in zip(x.logprobs, y.logprobs))
        assert worst <= TOL
    assert all(len(r.output_ids) == NEW_TOKENS for r in base)

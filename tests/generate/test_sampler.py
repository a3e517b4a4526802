"""The sampler draws in vocabulary order, so a seeded request's tokens do not depend on the batch it ran in; its
sampling supports are SGLang's kept sets, read off the same draw."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import pytest
import torch

from rollshard.generate.engines import EngineError, SamplingParams
from rollshard.generate.engines.embedded import EmbeddedEngine
from rollshard.generate.engines.sampler import sample_tokens, sample_tokens_with_support

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


# ---- sampling support -----------------------------------------------------------------------------

SUPPORT_TOL = 1e-6  # fp32: the engine's log(p / kept mass) against log_softmax over the support of the same logits


def test_support_worked_example():
    # probs [.5, .3, .15, .05]; top_k 3 keeps {0, 1, 2} (mass .95); top_p .7 keeps 0 and 1 (mass before 2 is .8).
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(3, 1)
    uniform = torch.tensor([0.9, 0.9, 0.1], dtype=torch.float64)  # .9 of the kept mass: the last kept token
    tokens, lps, supports = sample_tokens_with_support(
        logits, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 0.7, 1.0]), torch.tensor([3, -1, -1]), uniform,
        [True, True, True],
    )
    assert tokens.tolist() == [2, 1, 0]
    assert supports[0][0] == [0, 1, 2] and abs(supports[0][1] - math.log(0.15 / 0.95)) < SUPPORT_TOL
    assert supports[1][0] == [0, 1] and abs(supports[1][1] - math.log(0.3 / 0.8)) < SUPPORT_TOL
    assert supports[2] == ([0], 0.0)  # greedy: the token alone, as SGLang reports it
    # The draw is the same with or without the support, and rows that do not ask get None.
    plain, plain_lps = sample_tokens(
        logits, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 0.7, 1.0]), torch.tensor([3, -1, -1]), uniform
    )
    assert plain.tolist() == tokens.tolist() and plain_lps.tolist() == lps.tolist()
    _, _, some = sample_tokens_with_support(
        logits, torch.ones(3), torch.ones(3), torch.tensor([3, 3, 3]), uniform, [False, True, False]
    )
    assert some[0] is None and some[2] is None and some[1][0] == [0, 1, 2]


def _kept(logits_row, temperature, top_p, top_k):
    """SGLang's rule, from scratch: sort, keep the top-k, keep while the mass before a token is <= top_p."""
    probs = torch.softmax(logits_row / temperature, dim=-1).double()
    order = probs.argsort(descending=True, stable=True)
    before = probs[order].cumsum(0) - probs[order]
    keep = torch.ones_like(before, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    return {int(t) for t, k, b in zip(order, keep, before) if k and b <= top_p}


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 5), (0.5, 0.8, -1), (0.5, 0.8, 40), (1.0, 0.95, 5)])
def test_sampler_supports_and_sampling_logprobs_on_given_logits(temperature, top_p, top_k):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(16, 1024, generator=g) * 3  # [B, V]
    uniform = torch.rand(16, generator=g, dtype=torch.float64)
    b = logits.shape[0]
    tokens, lps, supports = sample_tokens_with_support(
        logits, torch.full((b,), temperature), torch.full((b,), top_p), torch.full((b,), top_k), uniform, [True] * b
    )
    logp = torch.log_softmax(logits / temperature, dim=-1)  # [B, V]
    for row, (tok, (support, slp)) in enumerate(zip(tokens.tolist(), supports)):
        assert set(support) == _kept(logits[row], temperature, top_p, top_k) and tok in support
        want = logp[row, tok] - torch.logsumexp(logp[row, support], dim=0)  # log softmax over the support
        assert abs(slp - float(want)) <= SUPPORT_TOL and float(lps[row]) <= slp <= 0.0


# Temperature 0.15 makes top-p bind on the random tiny GPT-2 (its distributions are nearly flat: at 1.0, top_p 0.8
# keeps ~800 of 1024 ids); top_k 5 binds at any temperature.
@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 5), (0.15, 0.8, -1), (0.15, 0.8, 100), (0.7, 0.8, 5)])
def test_embedded_supports_equal_an_independent_recomputation(
    tiny_gpt2, tf_logits, temperature, top_p, top_k
):
    from rollshard.generate.engines.embedded import load_causal_lm

    prompts = [[1, 5, 6, 7], list(range(100, 140)), [3, 4]]
    sp = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=8, return_sampling_mask=True, stop_token_ids=[]
    )

    async def go():
        async with EmbeddedEngine(tiny_gpt2, max_batch_size=4) as eng:
            eng.eos_ids = []
            return await asyncio.gather(*(eng.generate(p, dataclasses.replace(sp, sampling_seed=i)) for i, p in enumerate(prompts)))

    reference = load_causal_lm(tiny_gpt2)
    sizes = []
    for prompt, res in zip(prompts, asyncio.run(go())):
        assert len(res.sampling_support) == len(res.sampling_logprobs) == len(res.output_ids) == 8
        logits = tf_logits(reference, prompt, res.output_ids)  # [R, V]
        logp = torch.log_softmax(logits / temperature, dim=-1)  # [R, V]
        for t, (tok, support, slp) in enumerate(zip(res.output_ids, res.sampling_support, res.sampling_logprobs)):
            assert set(support) == _kept(logits[t], temperature, top_p, top_k) and len(set(support)) == len(support)
            assert tok in support
            want = logp[t, tok] - torch.logsumexp(logp[t, support], dim=0)  # log softmax over the support
            # TOL, not SUPPORT_TOL: the batched KV-cache forward's logits differ from this one by ~4e-7 (over T).
            assert abs(slp - float(want)) <= TOL and res.logprobs[t] <= slp <= 0.0
            probs = logp[t, support].exp()
            assert torch.all(probs[:-1] >= probs[1:] - 1e-6)  # descending probability (SGLang's), up to near-ties
            sizes.append(len(support))
    if top_k > 0:
        assert max(sizes) == top_k
    else:  # top-p alone decided: sizes vary with each distribution, never the whole vocabulary
        assert len(set(sizes)) > 1 and max(sizes) < 1024


def test_embedded_greedy_support_and_refusal_of_an_untruncated_request(tiny_gpt2):
    async def go():
        async with EmbeddedEngine(tiny_gpt2) as eng:
            greedy = await eng.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=3, return_sampling_mask=True))
            plain = await eng.generate([1, 2, 3], SamplingParams(top_k=5, max_new_tokens=3))
            try:
                await eng.generate([1, 2, 3], SamplingParams(max_new_tokens=3, return_sampling_mask=True), rid="r1")
            except EngineError as e:
                return greedy, plain, e

    greedy, plain, err = asyncio.run(go())
    assert greedy.sampling_support == [[t] for t in greedy.output_ids] and greedy.sampling_logprobs == [0.0] * 3
    assert plain.sampling_support is None and plain.sampling_logprobs is None
    assert str(err).startswith("request r1: return_sampling_mask needs top_k >= 1 or top_p < 1 (or temperature 0)")


def test_seeded_supports_are_the_same_at_any_batch_size(tiny_qwen3):
    # Truncating rows with and without the flag, mixed: the flag changes nothing of the draw, and each row's
    # tokens and supports are its own whatever the batch (a top-k cut moved by rounding would show here).
    rng = random.Random(1)
    requests = []
    for i in range(48):
        prompt = [rng.randrange(3, 1024) for _ in range(rng.randint(2, 30))]
        sp = SamplingParams(
            top_k=20, top_p=0.9, max_new_tokens=12, sampling_seed=5000 + i, stop_token_ids=[], return_sampling_mask=i % 3 != 0
        )
        requests.append((prompt, sp))
    runs = [_generate(tiny_qwen3, requests, bs, rev) for bs, rev in [(16, False), (1, False), (8, True)]]
    base = runs[0]
    for run in runs[1:]:
        for x, y in zip(base, run):
            assert x.output_ids == y.output_ids and x.sampling_support == y.sampling_support
            if x.sampling_logprobs is not None:
                assert max(abs(p - q) for p, q in zip(x.sampling_logprobs, y.sampling_logprobs)) <= TOL
    asked = [r for (_, sp), r in zip(requests, base) if sp.return_sampling_mask]
    assert all(r.sampling_support for r in asked) and all(r.sampling_support is None for r in base if r not in asked)
    # Unflagged rows draw exactly what they draw without any flagged neighbour.
    plain = [(p, dataclasses.replace(sp, return_sampling_mask=False)) for p, sp in requests]
    alone = _generate(tiny_qwen3, plain, 16, False)
    assert [r.output_ids for r in alone] == [r.output_ids for r in base]

"""The embedded engine: logprobs equal a teacher-forced recomputation, sampling rules, stops, seeds, weight updates."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import shutil

import pytest
import torch

from rollshard.generate.engines import EngineError, SamplingParams, make_engine
from rollshard.generate.engines.embedded import EmbeddedEngine, load_causal_lm
from rollshard.generate.engines.sampler import sample_tokens
from rollshard.store.models.tokenizer import TokenizerError, load_tokenizer

from .gated_engine import GatedEngine, until

TOL = 1e-5  # fp32 batched-with-cache vs unpadded full forward; measured ~1e-6
PROMPTS = [[1, 5, 6, 7], [1, *range(10, 40)], [3, 4], list(range(100, 181))]  # uneven lengths: 4, 31, 2, 81


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module", params=["tiny_gpt2", "tiny_qwen3"])
def model_path(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference(model_path):
    return load_causal_lm(model_path)


def test_sample_tokens_worked_example():
    # probs [0.1, 0.2, 0.3, 0.4]. The kept set is decided in sorted order (tokens 3, 2, 1, 0; cumsum .4, .7,
    # .9, 1.0), the token drawn by inverse CDF over the kept probabilities in vocabulary order (tokens 0..3).
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).repeat(7, 1)
    temp = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0])
    top_k = torch.tensor([2, 2, -1, -1, -1, -1, 2])
    uniform = torch.tensor([0.3, 0.5, 0.4, 0.25, 0.05, 0.3, 1.0], dtype=torch.float64)
    tokens, lps = sample_tokens(logits, temp, top_p, top_k, uniform)
    # row 0: top-k 2 keeps {2: .3, 3: .4}; kept cumsum in vocab order [0, 0, .3, .7]; target .3 * .7 = .21 -> token 2
    # row 1: target .5 * .7 = .35 > .3 -> token 3
    # row 2: top-p .5 keeps tokens whose preceding sorted mass <= .5: {3, 2}; target .4 * .7 = .28 -> token 2
    # row 3: no truncation; cumsum [.1, .3, .6, 1.0]; target .25 -> token 1
    # row 4: target .05 < .1 -> token 0
    # row 5: greedy -> argmax token 3, whatever the uniform
    # row 6: u = 1 (beyond the draw's range) puts the target on the total: the guard keeps the last kept token 3
    assert tokens.tolist() == [2, 3, 2, 1, 0, 3, 3]
    # logprobs are of the untruncated tempered distribution: log p(token)
    assert lps.tolist() == pytest.approx([math.log(p) for p in (0.3, 0.4, 0.3, 0.2, 0.1, 0.4, 0.4)], abs=1e-6)
    # The same guard never lands on a dropped token after the kept ones: top-k 2 keeps {0, 1} of [.4, .3, .2, .1].
    tokens, _ = sample_tokens(logits[:1].flip(-1), temp[:1], top_p[:1], top_k[:1], torch.ones(1, dtype=torch.float64))
    assert tokens.tolist() == [1]


def test_sample_tokens_temperature_scales_logprobs():
    # T = 0.5 squares the probabilities: [.01, .04, .09, .16] / .30
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    _, lp = sample_tokens(logits, torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([-1]), torch.tensor([0.0]))
    assert lp.item() == pytest.approx(math.log(0.01 / 0.30), abs=1e-6)  # u = 0 picks the first token in vocab order


def test_sample_tokens_frequencies_follow_top_k_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, _ = sample_tokens(
        logits, torch.ones(20000), torch.ones(20000), torch.full((20000,), 3), torch.rand(20000, generator=g)
    )
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    # top-3 renormalized: [0, .2, .3, .4] / .9; 20000 draws -> std ~0.0035
    assert freq.tolist() == pytest.approx([0.0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9], abs=0.015)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_teacher_forced_recomputation(model_path, reference, teacher_forced, temperature):
    async def go():
        async with EmbeddedEngine(model_path, seed=3) as eng:
            sp = SamplingParams(temperature=temperature, max_new_tokens=24, stop_token_ids=[])
            return await asyncio.gather(*(eng.generate(p, sp) for p in PROMPTS))

    for prompt, res in zip(PROMPTS, run(go())):
        assert len(res.logprobs) == len(res.output_ids) == res.completion_tokens > 0
        want = teacher_forced(reference, prompt, res.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(res.logprobs, want)) <= TOL
        assert res.weight_version == "0" and res.prompt_tokens == len(prompt)


def test_staggered_arrivals_join_the_running_batch(tiny_qwen3, teacher_forced, tf_logits):
    reference = load_causal_lm(tiny_qwen3)
    first_len, gate, rest_len = 100, 5, 30

    async def go():
        async with GatedEngine(tiny_qwen3, seed=5) as eng:
            eng.eos_ids = []  # every request runs to its length
            eng.block_at_step(gate)
            first = asyncio.ensure_future(eng.generate(PROMPTS[3], SamplingParams(max_new_tokens=first_len)))
            await eng.wait_blocked()  # the worker is inside decode step 5 of the first request
            sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=rest_len)
            rest = [asyncio.ensure_future(eng.generate(p, sp)) for p in PROMPTS[:3]]
            await until(lambda: eng.num_in_flight == 4)  # all three are queued
            eng.release.set()
            return await asyncio.gather(first, *rest), eng.batch_sizes

    results, sizes = run(go())
    # The first request decodes alone for 5 steps; the others are prefilled right after step 5 and decode
    # with it (29 steps after their prefill token); it then runs alone to its 100th token (99 steps in all).
    assert sizes == [1] * gate + [4] * (rest_len - 1) + [1] * (first_len - 1 - gate - (rest_len - 1))
    for i, (prompt, res) in enumerate(zip([PROMPTS[3], *PROMPTS[:3]], results)):
        assert len(res.output_ids) == (first_len if i == 0 else rest_len)
        temp = 1.0 if i == 0 else 0.7
        want = teacher_forced(reference, prompt, res.output_ids, temp)
        assert max(abs(a - b) for a, b in zip(res.logprobs, want)) <= TOL
        if i:  # top-k 20: every sampled token ranks among the 20 most likely
            logits = tf_logits(reference, prompt, res.output_ids)
            ranks = (logits > logits.gather(-1, torch.tensor(res.output_ids)[:, None])).sum(-1)
            assert int(ranks.max()) < 20


def test_stops_on_token_ids_strings_and_length(tiny_gpt2):
    prompt = PROMPTS[1]

    async def go():
        async with EmbeddedEngine(tiny_gpt2) as eng:
            greedy = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[])
            base = await eng.generate(prompt, greedy)
            stop_id = base.output_ids[4]
            by_id = await eng.generate(
                prompt, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop_id])
            )
            stop_str = base.text[-3:]
            by_str = await eng.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=12, stop=[stop_str]))
            kept = await eng.generate(
                prompt, SamplingParams(temperature=0.0, max_new_tokens=12, stop=[stop_str], no_stop_trim=True)
            )
            zero = await eng.generate(prompt, SamplingParams(max_new_tokens=0))
            return base, stop_id, by_id, stop_str, by_str, kept, zero

    base, stop_id, by_id, stop_str, by_str, kept, zero = run(go())
    assert base.finish_reason == "length" and base.finish_detail == {"length": 12} and len(base.output_ids) == 12
    first = base.output_ids.index(stop_id)
    # The stop token is part of the response (and has its logprob), as SGLang returns it.
    assert by_id.output_ids == base.output_ids[: first + 1] and by_id.logprobs == pytest.approx(
        base.logprobs[: first + 1], abs=TOL
    )
    assert by_id.finish_reason == "stop" and by_id.finish_detail == {"matched": stop_id}
    assert by_str.finish_reason == "stop" and by_str.finish_detail == {"matched": stop_str}
    assert stop_str not in by_str.text and base.text.startswith(by_str.text)
    assert kept.output_ids == by_str.output_ids and kept.text.endswith(stop_str)
    assert zero.output_ids == [] and zero.logprobs == [] and zero.finish_reason == "length"


def test_stops_on_eos(tiny_gpt2):
    eng = EmbeddedEngine(tiny_gpt2)
    assert eng.eos_ids == [2, 0]  # <|im_end|> from the tokenizer, <|endoftext|> from generation_config.json
    base = run(eng.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=10)))
    eng.eos_ids = [base.output_ids[2]]  # the random model rarely samples its real eos: declare one it will
    res = run(eng.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=10)))
    first = base.output_ids.index(base.output_ids[2])
    assert res.output_ids == base.output_ids[: first + 1]
    assert res.finish_reason == "stop" and res.finish_detail == {"matched": base.output_ids[2]}


def test_ignore_eos_ignores_eos_and_stop_token_ids_but_not_stop_strings(tiny_gpt2):
    greedy = dict(temperature=0.0, max_new_tokens=10)

    async def go():
        async with EmbeddedEngine(tiny_gpt2) as eng:
            base = await eng.generate(PROMPTS[0], SamplingParams(**greedy, stop_token_ids=[]))
            eng.eos_ids = [base.output_ids[2]]  # an eos the greedy response reaches at its 3rd token
            stopped = await eng.generate(PROMPTS[0], SamplingParams(**greedy))
            sp = SamplingParams(**greedy, stop_token_ids=[base.output_ids[1]])
            ignored = await eng.generate(PROMPTS[0], sp, ignore_eos=True)
            by_str = await eng.generate(PROMPTS[0], SamplingParams(**greedy, stop=[base.text[-2:]]), ignore_eos=True)
            return base, stopped, ignored, by_str

    base, stopped, ignored, by_str = run(go())
    assert stopped.finish_reason == "stop" and len(stopped.output_ids) <= 3
    # As SGLang's ignore_eos: neither the eos nor a stop token id ends the request; it runs to max_new_tokens.
    assert ignored.output_ids == base.output_ids and ignored.finish_reason == "length" and len(ignored.output_ids) == 10
    assert ignored.logprobs == pytest.approx(base.logprobs, abs=TOL)
    # A stop string still does.
    assert by_str.finish_reason == "stop" and by_str.finish_detail == {"matched": base.text[-2:]}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ignore_eos_samples_past_the_eos_from_the_unmasked_distribution(
    tiny_gpt2, eos_everywhere, teacher_forced, temperature
):
    n = 24
    sp = SamplingParams(temperature=temperature, max_new_tokens=n, sampling_seed=11)

    async def go(path, sampling, **kw):
        async with EmbeddedEngine(path) as eng:
            return await eng.generate(PROMPTS[1], sampling, **kw)

    stopped = run(go(eos_everywhere, sp))
    ignored = run(go(eos_everywhere, dataclasses.replace(sp, ignore_eos=True)))
    by_keyword = run(go(eos_everywhere, sp, ignore_eos=True))
    plain = run(go(tiny_gpt2, dataclasses.replace(sp, ignore_eos=True)))  # the model's own (rare) eos ignored too
    assert stopped.finish_reason == "stop" and stopped.finish_detail == {"matched": stopped.output_ids[0]}
    assert len(stopped.output_ids) == 1
    # Every token drawn is an eos here, and none ends the request: it runs to max_new_tokens.
    assert ignored.finish_reason == "length" and ignored.finish_detail == {"length": n}
    assert len(ignored.output_ids) == len(ignored.logprobs) == n
    # SGLang masks no eos logit for ignore_eos: the same seed draws the same tokens as from a model whose eos
    # never comes up, and the logprobs are the trainer's log softmax(logits / T), the eos ids included.
    assert ignored.output_ids == plain.output_ids and ignored.output_ids[0] == stopped.output_ids[0]
    want = teacher_forced(load_causal_lm(tiny_gpt2), PROMPTS[1], ignored.output_ids, temperature)
    assert max(abs(a - b) for a, b in zip(ignored.logprobs, want)) <= TOL
    assert by_keyword.output_ids == ignored.output_ids and by_keyword.logprobs == ignored.logprobs


def test_seeded_sampling_is_reproducible(tiny_gpt2):
    async def go(seed):
        async with EmbeddedEngine(tiny_gpt2, seed=seed) as eng:
            same = [
                await eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=16, sampling_seed=42)) for _ in range(2)
            ]
            free = await asyncio.gather(*(eng.generate(p, SamplingParams(max_new_tokens=16)) for p in PROMPTS))
            return same, free

    (a, b), free0 = run(go(0))
    _, free0_again = run(go(0))
    _, free1 = run(go(1))
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
    assert [r.output_ids for r in free0] == [r.output_ids for r in free0_again]
    assert [r.output_ids for r in free0] != [r.output_ids for r in free1]


def test_load_weights_changes_outputs_and_version(tiny_gpt2, tiny_gpt2_seed1, teacher_forced):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)

    async def go():
        async with GatedEngine(tiny_gpt2) as eng:
            eng.eos_ids = []  # the running request must reach the gate
            before = await eng.generate(PROMPTS[0], greedy)
            eng.block_at_step(5)
            running = asyncio.ensure_future(
                eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=40, stop_token_ids=[]))
            )
            await eng.wait_blocked()  # the running request is mid-decode (5 of its 40 tokens)
            swap = asyncio.ensure_future(eng.load_weights(tiny_gpt2_seed1))
            await until(lambda: eng._swap is not None)  # the new weights are loaded and the swap requested
            eng.release.set()
            version = await swap
            after = await eng.generate(PROMPTS[0], greedy)
            info = await eng.model_info()
            named = await eng.load_weights(tiny_gpt2, "v-restored")
            return before, await running, version, after, info, named

    before, running, version, after, info, named = run(go())
    assert version == "1" and after.weight_version == "1" and info["weight_version"] == "1"
    assert info["model_path"] == str(tiny_gpt2_seed1) and named == "v-restored"
    # A request in flight finishes on the weights it started with: every logprob is the old model's.
    assert running.weight_version == "0" and len(running.output_ids) == 40
    old_model = load_causal_lm(tiny_gpt2)
    want = teacher_forced(old_model, PROMPTS[1], running.output_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(running.logprobs, want)) <= TOL
    new_model = load_causal_lm(tiny_gpt2_seed1)
    assert (
        max(abs(a - b) for a, b in zip(after.logprobs, teacher_forced(new_model, PROMPTS[0], after.output_ids, 0.0)))
        <= TOL
    )
    assert max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs)) > 0.01


def test_user_errors_name_the_request(tiny_gpt2):
    eng = make_engine(f"embedded:{tiny_gpt2}")
    assert isinstance(eng, EmbeddedEngine)
    with pytest.raises(
        EngineError, match=r"request r-long: prompt of 1024 tokens does not fit the model's context of 1024"
    ):
        run(eng.generate([5] * 1024, SamplingParams(), rid="r-long"))
    with pytest.raises(EngineError, match=r"request r-vocab: input_ids must lie in \[0, 1024\)"):
        run(eng.generate([5, 4096], SamplingParams(), rid="r-vocab"))
    with pytest.raises(EngineError, match=r"cannot load a causal LM from"):
        run(eng.load_weights("/nonexistent/checkpoint"))
    # As SGLang: prompt + max_new_tokens beyond the context is refused, not silently shortened.
    with pytest.raises(
        EngineError, match=r"request r-ctx: 1020 prompt tokens \+ max_new_tokens 50 exceed the model's context of 1024"
    ):
        run(eng.generate([5] * 1020, SamplingParams(max_new_tokens=50), rid="r-ctx"))
    eng.eos_ids = []
    res = run(eng.generate([5] * 1020, SamplingParams(max_new_tokens=4)))
    assert res.finish_reason == "length" and len(res.output_ids) == 4
    # Refused in generate(), not in the worker, where a failure would fail the whole batch.
    with pytest.raises(EngineError, match=r"request r-seed: sampling_seed 18446744073709551616 is not a 64-bit"):
        run(eng.generate([5, 6], SamplingParams(sampling_seed=2**64), rid="r-seed"))
    # A top_k beyond the vocabulary keeps every token, like -1: same tokens for the same seed.
    huge_k, no_k = (
        run(eng.generate([5, 6], SamplingParams(max_new_tokens=4, top_k=k, sampling_seed=7))) for k in (10**30, -1)
    )
    assert huge_k.output_ids == no_k.output_ids and len(huge_k.output_ids) == 4


def test_a_model_folder_without_its_tokenizer_fails_at_start(tiny_gpt2, tmp_path):
    # transformers 5.x loads such a folder as an empty tokenizer instead of raising; every request would
    # then fail with "empty input_ids". The folder is refused when it is loaded, naming what it lacks.
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_gpt2, folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink()
    want = rf"no tokenizer vocabulary in '{folder}'.*tokenizer\.json.*rollshard-generate init-model"
    with pytest.raises(TokenizerError, match=want):
        load_tokenizer(folder)
    with pytest.raises(EngineError, match=want):
        EmbeddedEngine(folder)


def test_abort_and_abort_all_answer_with_the_tokens_so_far(tiny_gpt2, teacher_forced):
    reference = load_causal_lm(tiny_gpt2)

    async def go():
        async with GatedEngine(tiny_gpt2) as eng:
            eng.eos_ids = []
            eng.block_at_step(3)
            sp = SamplingParams(max_new_tokens=40)
            running = [asyncio.ensure_future(eng.generate(p, sp, rid=f"r{i}")) for i, p in enumerate(PROMPTS[:2])]
            await eng.wait_blocked()  # both rows are mid-decode: 3 tokens each, the worker inside step 3
            found = eng.abort_all(), eng.abort("nobody")
            eng.release.set()
            results = await asyncio.gather(*running)
            return found, results, eng.abort("r0")  # answered: nothing left to abort

    (all_found, nobody_found), results, after = run(go())
    assert all_found is True and nobody_found is False and after is False
    for prompt, res in zip(PROMPTS[:2], results):
        assert res.finish_reason == "abort"
        assert res.finish_detail == {"message": "Aborted", "status_code": None, "err_type": None}
        assert len(res.output_ids) == len(res.logprobs) == 4  # the prefill's token and 3 decode steps
        want = teacher_forced(reference, prompt, res.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(res.logprobs, want)) <= TOL


def test_a_weight_update_without_a_version_needs_a_number_to_count_from(tiny_gpt2, tiny_gpt2_seed1):
    async def go():
        async with EmbeddedEngine(tiny_gpt2, weight_version="v3") as eng:
            refused = r"records no weight_version and the served one \('v3'\) is not a number"
            with pytest.raises(EngineError, match=refused):
                await eng.load_weights(tiny_gpt2_seed1)  # keeping "v3" would label two policies alike
            return await eng.load_weights(tiny_gpt2_seed1, "v4"), eng.weight_version

    assert run(go()) == ("v4", "v4")

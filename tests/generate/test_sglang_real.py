"""The real SGLang server (CPU, tiny GPT-2) driven by the client: logprobs, stops, aborts, weight updates.

Needs the separate environment of ``scripts/make_sglang_env.sh`` (``$ROLLSHARD_SGLANG_VENV``,
default: ``make_sglang_env.sh --path``); skipped without it, failed without it when
``ROLLSHARD_REQUIRE_SGLANG`` is set. One server per module:
it takes ~30 s to start on an idle machine.
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest
import torch

from rollshard.generate.engines import SamplingParams, make_engine
from rollshard.generate.engines.base import EngineSettingsError
from rollshard.generate.engines.embedded import load_causal_lm
from rollshard.store.format.schema import WeightSpan

from tests.conftest import launch_sglang

pytestmark = pytest.mark.sglang

TOL = 1e-4  # SGLang's CPU torch_native fp32 path vs transformers fp32; measured ~5e-7
ABORT_ATTEMPTS = 5  # P(eos before the abort) per attempt is small; five in a row would be a bug
PROMPTS = [[1, 5, 6, 7], [1, *range(10, 40)], [3, 4], list(range(100, 181))]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def sglang_server(tiny_gpt2, tmp_path_factory):
    with launch_sglang(tiny_gpt2, tmp_path_factory.mktemp("sglang"), max_total_tokens=4096) as url:
        yield url


@pytest.fixture(scope="module")
def reference(tiny_gpt2):
    return load_causal_lm(tiny_gpt2)


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, -1), (0.7, 1.0, -1), (0.0, 1.0, -1), (0.7, 0.9, 20)])
def test_logprobs_equal_teacher_forced(sglang_server, reference, teacher_forced, temperature, top_p, top_k):
    async def go():
        async with make_engine(sglang_server) as eng:
            info = (await eng.health_check())[0]
            sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=24)
            return info, await asyncio.gather(*(eng.generate(p, sp) for p in PROMPTS))

    info, results = run(go())
    assert info["model_type"] == "gpt2"
    for prompt, res in zip(PROMPTS, results):
        assert len(res.logprobs) == len(res.output_ids) == res.completion_tokens > 0
        # Untruncated tempered logprobs, also under top-p/top-k (SGLang's default definition).
        want = teacher_forced(reference, prompt, res.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(res.logprobs, want)) <= TOL
        # What the server sent, not what the parser would synthesize from weight_version: SGLang 0.5.23
        # sends its spans (measured on CPU), one span of the server's version over the whole response.
        whole = {"version": info["weight_version"], "start": 0, "end": len(res.output_ids)}
        assert res.meta["weight_versions_sent"] == [whole]
        assert res.weight_versions == [WeightSpan(**whole)] and res.weight_version == info["weight_version"]


def test_stop_token_is_returned_with_its_logprob_like_the_embedded_engine(sglang_server):
    async def go():
        async with make_engine(sglang_server) as eng:
            base = await eng.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=12))
            stop_id = base.output_ids[4]
            stopped = await eng.generate(
                PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop_id])
            )
            return base, stop_id, stopped

    base, stop_id, stopped = run(go())
    first = base.output_ids.index(stop_id)
    assert stopped.output_ids == base.output_ids[: first + 1] and len(stopped.logprobs) == first + 1
    assert stopped.finish_reason == "stop" and stopped.finish_detail["matched"] == stop_id


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ignore_eos_runs_past_stop_ids_like_the_embedded_engine(sglang_server, tiny_gpt2, temperature):
    vocab = load_causal_lm(tiny_gpt2).config.vocab_size
    # Every id a stop id: without ignore_eos any first token ends the request, on either engine, whatever is drawn.
    sp = SamplingParams(temperature=temperature, max_new_tokens=16, stop_token_ids=list(range(vocab)))

    async def both(sampling):
        async with make_engine(sglang_server) as real, make_engine(f"embedded:{tiny_gpt2}") as embedded:
            return await real.generate(PROMPTS[1], sampling), await embedded.generate(PROMPTS[1], sampling)

    stopped = run(both(sp))
    ignored = run(both(dataclasses.replace(sp, ignore_eos=True)))
    for res in stopped:
        assert (res.finish_reason, len(res.output_ids)) == ("stop", 1)
        assert res.finish_detail["matched"] == res.output_ids[0]
    for res in ignored:
        assert (res.finish_reason, res.finish_detail, len(res.output_ids), len(res.logprobs)) == (
            "length", {"length": 16}, 16, 16
        )
    if temperature == 0.0:  # greedy: the same tokens, and no logit masked on either side
        assert ignored[0].output_ids == ignored[1].output_ids
        assert max(abs(a - b) for a, b in zip(ignored[0].logprobs, ignored[1].logprobs)) <= TOL


def test_aborted_request_keeps_matching_logprobs(sglang_server):
    # The random model may sample eos before the abort lands (SGLang ignores sampling
    # seeds here), so a request that finished by itself is retried; one must abort.
    async def attempt(i: int):
        rid = f"to-abort-{i}"
        loop = asyncio.get_running_loop()
        async with make_engine(sglang_server) as eng, aiohttp.ClientSession() as s:
            # With the sampling support asked for: an abort keeps it aligned with the tokens kept.
            sp = SamplingParams(max_new_tokens=1000, top_k=20, return_sampling_mask=True)
            task = asyncio.ensure_future(eng.generate([1, 5, 6, 7], sp, rid=rid))
            # An abort that arrives before the server has registered the rid is a no-op (SGLang answers 200
            # either way), so keep aborting until the request has ended, however slow the machine is.
            deadline = loop.time() + 300
            while not task.done():
                assert loop.time() < deadline, "the server neither finished nor aborted the request"
                async with s.post(sglang_server + "/abort_request", json={"rid": rid}) as r:
                    assert r.status == 200
                await asyncio.wait({task}, timeout=0.05)
            return task.result()

    results = []
    for i in range(ABORT_ATTEMPTS):
        results.append(run(attempt(i)))
        if results[-1].finish_reason == "abort":
            break
    res = results[-1]
    assert res.finish_reason == "abort", [r.finish_reason for r in results]
    assert len(res.logprobs) == len(res.output_ids) == len(res.sampling_support) == len(res.sampling_logprobs) < 1000
    assert all(t in support for t, support in zip(res.output_ids, res.sampling_support))
    assert res.finish_detail["status_code"] is None  # a client's abort is final: no 5xx, so not retried
    assert all(r.finish_reason == "stop" for r in results[:-1])  # only natural stops are retried


def test_a_plain_server_passes_the_preferred_sampling_check(sglang_server):
    async def go():
        async with make_engine(sglang_server) as eng:
            return await eng.health_check(), await eng.health_check(SamplingParams(temperature=0.3, stop=["x"]))

    default, custom = run(go())
    assert default[0]["preferred_sampling_params"] is None and custom[0]["preferred_sampling_params"] is None


def test_update_weights_from_disk_changes_logprobs_and_version(
    sglang_server, tiny_gpt2, tiny_gpt2_seed1, teacher_forced
):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)

    async def go():
        async with make_engine(sglang_server) as eng:
            before = await eng.generate(PROMPTS[1], greedy)
            answer = await eng.update_weights_from_disk(str(tiny_gpt2_seed1), "7")
            after = await eng.generate(PROMPTS[1], greedy)
            info = await eng.model_info()
            await eng.update_weights_from_disk(str(tiny_gpt2), "8")  # leave the module's server on its weights
            return before, answer, after, info

    before, answer, after, info = run(go())
    assert answer[0]["success"] is True and answer[0]["num_paused_requests"] == 0
    assert after.weight_version == "7" and info["weight_version"] == "7" and before.weight_version != "7"
    assert max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs)) > 0.01
    want = teacher_forced(load_causal_lm(tiny_gpt2_seed1), PROMPTS[1], after.output_ids, 0.0)
    assert max(abs(a - b) for a, b in zip(after.logprobs, want)) <= TOL


# ---- return_sampling_mask ---------------------------------------------------------------------------


def _kept(logits_row, temperature, top_p, top_k):
    """SGLang's kept set from scratch: sort the tempered probabilities, top-k, then mass before a token <= top_p."""
    probs = torch.softmax(logits_row / temperature, dim=-1).double()
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    return {int(t) for rank, (t, b) in enumerate(zip(order, before)) if rank < top_k and b <= top_p}


# top_k 20 at T 1; top_p 0.8 under a top-k cap of 1000 at T 0.15, where top-p decides (the random model's
# distributions are nearly flat: ~230-430 ids kept, measured); greedy (SGLang runs it as top_k 1).
@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 20), (0.15, 0.8, 1000), (0.0, 1.0, -1)])
def test_sampling_support_equals_teacher_forced(sglang_server, reference, tf_logits, temperature, top_p, top_k):
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=16, return_sampling_mask=True)

    async def go():
        async with make_engine(sglang_server) as eng:
            await eng.health_check(sp)  # reads the server's --sampling-mask-max-tokens (4096) and accepts
            return await asyncio.gather(*(eng.generate(p, sp) for p in PROMPTS))

    sizes = []
    for prompt, res in zip(PROMPTS, run(go())):
        assert len(res.sampling_support) == len(res.sampling_logprobs) == len(res.output_ids) > 0
        if temperature == 0.0:
            assert res.sampling_support == [[t] for t in res.output_ids] and res.sampling_logprobs == [0.0] * len(res.output_ids)
            continue
        logits = tf_logits(reference, prompt, res.output_ids)  # [R, V]
        logp = torch.log_softmax(logits / temperature, dim=-1)  # [R, V]
        diffs = []
        for t, (tok, support, slp) in enumerate(zip(res.output_ids, res.sampling_support, res.sampling_logprobs)):
            assert set(support) == _kept(logits[t], temperature, top_p, top_k) and tok in support
            diffs.append(abs(slp - float(logp[t, tok] - torch.logsumexp(logp[t, support], dim=0))))
            sizes.append(len(support))
        assert max(diffs) <= TOL
    if top_k == 20:
        assert set(sizes) == {20}
    elif temperature > 0:
        assert len(set(sizes)) > 1 and max(sizes) < top_k  # top-p decided under the cap


def test_a_top_k_over_the_servers_cap_is_refused_at_the_health_check(sglang_server):
    async def go():
        async with make_engine(sglang_server) as eng:
            with pytest.raises(EngineSettingsError) as e:
                await eng.health_check(SamplingParams(top_k=5000, return_sampling_mask=True))
            return str(e.value)

    assert "--sampling-mask-max-tokens (4096)" in run(go())

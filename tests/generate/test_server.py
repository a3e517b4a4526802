"""``rollshard-generate serve`` in a subprocess, driven over real HTTP by the SGLang client."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rollshard.generate.engines import EngineError, SamplingParams, make_engine
from rollshard.generate.engines.embedded import load_causal_lm
from rollshard.store.tokenizer import encode, load_tokenizer

TOL = 1e-5
PROMPTS = [[1, 5, 6, 7], [1, *range(10, 40)], [3, 4], list(range(100, 181))]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def reference(tiny_gpt2):
    return load_causal_lm(tiny_gpt2)


def test_native_generate_response_shape(embedded_server, tiny_gpt2):
    async def go():
        async with aiohttp.ClientSession() as s:
            payload = {
                "text": "What is 2 + 3?",
                "sampling_params": {"temperature": 0, "max_new_tokens": 5},
                "return_logprob": True,
                "rid": "shape-1",
            }
            async with s.post(embedded_server + "/generate", json=payload) as r:
                body = await r.json()
            async with s.post(embedded_server + "/generate", json={**payload, "return_logprob": False}) as r:
                no_lp = await r.json()
            async with s.post(embedded_server + "/generate", json={"input_ids": [[1, 2], [3]]}) as r:
                batched = (r.status, await r.json())
            async with s.post(
                embedded_server + "/generate", json={"input_ids": [1, 2], "sampling_params": {"min_p": 0.1}}
            ) as r:
                unsupported = (r.status, await r.json())
            async with s.post(embedded_server + "/update_weights_from_disk", data=b"not json") as r:
                assert r.status == 400 and "request body is not JSON" in await r.text()
            return body, no_lp, batched, unsupported

    body, no_lp, batched, unsupported = run(go())
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "shape-1" and meta["finish_reason"] == {"type": "length", "length": 5}
    assert (
        meta["completion_tokens"] == 5
        and meta["prompt_tokens"] == len(encode(load_tokenizer(tiny_gpt2), "What is 2 + 3?"))
        and meta["weight_version"] == "0"
    )
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 5}]
    assert [item[1] for item in meta["output_token_logprobs"]] == body["output_ids"]
    assert all(item[0] <= 0 and item[2] is None for item in meta["output_token_logprobs"])
    assert "output_token_logprobs" not in no_lp["meta_info"] and no_lp["output_ids"] == body["output_ids"]
    assert batched[0] == 400 and "batched requests are not supported" in batched[1]["error"]["message"]
    assert unsupported[0] == 400 and "['min_p']" in unsupported[1]["error"]["message"]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_client_logprobs_equal_teacher_forced(embedded_server, reference, teacher_forced, temperature):
    async def go():
        async with make_engine(embedded_server) as eng:
            await eng.health_check()
            sp = SamplingParams(temperature=temperature, top_p=0.95, max_new_tokens=16)
            return await asyncio.gather(
                *(eng.generate(p, sp, rid=f"t{temperature}-{i}") for i, p in enumerate(PROMPTS))
            )

    for prompt, res in zip(PROMPTS, run(go())):
        assert len(res.logprobs) == len(res.output_ids) == res.completion_tokens > 0
        want = teacher_forced(reference, prompt, res.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(res.logprobs, want)) <= TOL


def test_client_error_on_a_request_the_server_refuses(embedded_server):
    async def go():
        async with make_engine(embedded_server) as eng:
            with pytest.raises(EngineError) as e:
                await eng.generate([5] * 1000, SamplingParams(max_new_tokens=100), rid="too-long")
            return str(e.value)

    msg = run(go())
    assert msg.startswith("request too-long: HTTP 400 from http://127.0.0.1:")
    assert "1000 prompt tokens + max_new_tokens 100 exceed the model's context of 1024" in msg


def test_update_weights_from_disk_changes_outputs_and_version(
    embedded_server, tiny_gpt2, tiny_gpt2_seed1, teacher_forced
):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)

    async def go():
        async with make_engine(embedded_server) as eng:
            before = await eng.generate(PROMPTS[1], greedy)
            answer = await eng.update_weights_from_disk(str(tiny_gpt2_seed1), "7")
            after = await eng.generate(PROMPTS[1], greedy)
            info = await eng.model_info()
            renamed = await eng.update_weight_version("v8")
            last = await eng.generate(PROMPTS[1], greedy)
            async with aiohttp.ClientSession() as s:
                async with s.post(embedded_server + "/flush_cache") as r:
                    flushed = r.status
            with pytest.raises(
                EngineError, match=r"POST /update_weights_from_disk failed on .*cannot load a causal LM"
            ):
                await eng.update_weights_from_disk("/nonexistent/ckpt", "9")
            await eng.update_weights_from_disk(str(tiny_gpt2), "0")  # leave the module's server as it was
            return before, answer, after, info, renamed, last, flushed

    before, answer, after, info, renamed, last, flushed = run(go())
    assert answer == [
        {"success": True, "message": "Succeeded to update model weights (weight_version 7).", "num_paused_requests": 0}
    ]
    assert before.weight_version == "0" and after.weight_version == "7" and info["weight_version"] == "7"
    assert renamed[0]["success"] is True and last.weight_version == "v8" and last.output_ids == after.output_ids
    assert flushed == 200
    assert max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs)) > 0.01
    new_model = load_causal_lm(tiny_gpt2_seed1)
    want = teacher_forced(new_model, PROMPTS[1], after.output_ids, 0.0)
    assert max(abs(a - b) for a, b in zip(after.logprobs, want)) <= TOL

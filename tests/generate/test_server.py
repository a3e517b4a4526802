"""``rollshard-generate serve``: in a subprocess, driven over real HTTP by the SGLang client; and in process
(aiohttp's test server) where a test needs to gate the engine or the tokenizer."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer

from rollshard.generate.engines import EngineError, SamplingParams, make_engine
from rollshard.generate.engines.base import NEUTRAL_SAMPLING
from rollshard.generate.engines.embedded import EmbeddedEngine, load_causal_lm
from rollshard.generate.server import Server
from rollshard.store.models.tokenizer import encode, load_tokenizer

from .gated_engine import GatedEngine, until

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
    assert unsupported[0] == 400 and "sampling_params.min_p = 0.1 is not supported" in unsupported[1]["error"]["message"]


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


# ---- hostile input: a 400 naming the field, and the server stays up ------------------------------------

OK_IDS = [1, 5, 6]
BAD_SAMPLING = [
    ({"max_new_tokens": "abc"}, "max_new_tokens"),
    ({"max_new_tokens": None}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),  # bool is an int subclass in Python
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),  # json.dumps writes NaN, json.loads reads it
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": "x"}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", None]}, "stop"),
    ({"stop": ["s"] * 65}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),  # each stop string is matched against a decoded tail at every step
    ({"stop_token_ids": "2"}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"no_stop_trim": "yes"}, "no_stop_trim"),
    ({"no_stop_trim": 1}, "no_stop_trim"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"sampling_seed": "1"}, "sampling_seed"),
    ({"sampling_seed": -1}, "sampling_seed"),
    ({"sampling_seed": 2**64}, "sampling_seed"),
    ({"sampling_seed": True}, "sampling_seed"),
    ({"min_p": 0.1}, "min_p"),
    ({"min_new_tokens": 5}, "min_new_tokens"),
    ({"min_new_tokens": False}, "min_new_tokens"),  # False == 0, but not the integer 0
    ({"repetition_penalty": True}, "repetition_penalty"),
    ({"ignore_eos": 0}, "ignore_eos"),  # a boolean, as SGLang's
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"n": 2}, "n"),
    ({"foo": 1}, "foo"),
]
BAD_BODIES = [({"input_ids": OK_IDS, "sampling_params": sp}, f"sampling_params.{field}") for sp, field in BAD_SAMPLING]
BAD_BODIES += [
    ({"input_ids": OK_IDS, "sampling_params": "greedy"}, "sampling_params"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [1, True]}, "input_ids"),
    ({"input_ids": [1.5]}, "input_ids"),
    ({"input_ids": [[1, 2]]}, "batched requests are not supported"),
    ({"input_ids": []}, "empty input_ids"),
    ({"input_ids": [10**30]}, "input_ids must lie in [0, 1024)"),
    ({"input_ids": OK_IDS, "text": "hi"}, "exactly one of input_ids and text"),
    ({}, "exactly one of input_ids and text"),
    ({"text": 5}, "text"),
    ({"input_ids": OK_IDS, "rid": 5}, "rid"),
    ({"input_ids": OK_IDS, "rid": ["a"]}, "rid"),
    ({"input_ids": OK_IDS, "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": OK_IDS, "return_logprob": 1}, "return_logprob"),
    ({"input_ids": OK_IDS, "stream": True}, "stream"),
    ({"input_ids": OK_IDS, "stream": "no"}, "stream"),
    ({"input_ids": OK_IDS, "logprob_start_len": "x"}, "logprob_start_len"),
]


def test_ignore_eos_runs_past_stop_token_ids_over_http(embedded_server):
    async def go():
        async with aiohttp.ClientSession() as s:
            greedy = {"temperature": 0, "max_new_tokens": 8}
            _, base = await _post(s, embedded_server + "/generate", {"input_ids": PROMPTS[1], "sampling_params": greedy})
            stop = {**greedy, "stop_token_ids": [base["output_ids"][1]]}
            _, stopped = await _post(s, embedded_server + "/generate", {"input_ids": PROMPTS[1], "sampling_params": stop})
            body = {"input_ids": PROMPTS[1], "sampling_params": {**stop, "ignore_eos": True}, "return_logprob": True}
            return base, stopped, await _post(s, embedded_server + "/generate", body)

    base, stopped, (status, ignored) = run(go())
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop" and len(stopped["output_ids"]) <= 2
    assert status == 200 and ignored["output_ids"] == base["output_ids"] and len(ignored["output_ids"]) == 8
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert len(ignored["meta_info"]["output_token_logprobs"]) == 8


def test_hostile_generate_bodies_are_400_naming_the_field(embedded_server):
    async def go():
        answers = []
        async with aiohttp.ClientSession() as s:
            for body, _ in BAD_BODIES:
                async with s.post(embedded_server + "/generate", json=body) as r:
                    answers.append((r.status, str((await r.json(content_type=None)).get("error"))))
            for path, body in [
                ("/generate", [1]),
                ("/abort_request", {"rid": 5}),
                ("/update_weights_from_disk", {"model_path": ["x"]}),
                ("/update_weight_version", {"new_version": 8}),
            ]:
                async with s.post(embedded_server + path, json=body) as r:
                    answers.append((r.status, await r.text()))
            # The SGLang client sends base's neutral keys with every request: accepted at those values.
            ok_body = {
                "input_ids": OK_IDS,
                "sampling_params": {**NEUTRAL_SAMPLING, "temperature": 0, "max_new_tokens": 3, "stop": "\x00never"},
                "return_logprob": True,
            }
            async with s.post(embedded_server + "/generate", json=ok_body) as r:
                ok = (r.status, await r.json())
            async with s.get(embedded_server + "/health") as r:
                health = r.status
        return answers, ok, health

    answers, ok, health = run(go())
    for (body, field), (status, message) in zip(BAD_BODIES, answers):
        assert status == 400 and field in message, (body, status, message)
    others = answers[len(BAD_BODIES) :]
    assert [st for st, _ in others] == [400] * 4
    assert "JSON object" in others[0][1] and "rid must be a string" in others[1][1]
    assert "model_path (a string) is required" in others[2][1] and "new_version (a string)" in others[3][1]
    assert ok[0] == 200 and len(ok[1]["output_ids"]) == 3 and health == 200


# ---- the event loop only routes: size limits before tokenizing, tokenizing on a thread -----------------


class GatedTokenizer:
    """Delegates to a real tokenizer; ``encode`` counts its calls and, when gated, waits for ``release``."""

    def __init__(self, inner, *, gated: bool) -> None:
        self.inner = inner
        self.gated = gated
        self.calls = 0
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()

    def encode(self, text, **kwargs):
        self.calls += 1
        self.entered.set()
        # Bounded, so that with tokenization on the event loop (which /health then waits behind) the test
        # fails instead of deadlocking.
        if self.gated:
            self.release.wait(15.0)
        out = self.inner.encode(text, **kwargs)
        self.returned.set()
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextlib.asynccontextmanager
async def in_process_server(engine: EmbeddedEngine):
    """``Server(engine)`` on 127.0.0.1 in this event loop; yields (session, base URL)."""
    async with TestServer(Server(engine).app, host="127.0.0.1") as ts, aiohttp.ClientSession() as s:
        try:
            yield s, str(ts.make_url("")).rstrip("/")
        finally:
            await engine.close()


async def _post(s: aiohttp.ClientSession, url: str, body) -> tuple[int, dict]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


def test_health_answers_while_a_text_is_being_tokenized(tiny_gpt2):
    async def go():
        eng = EmbeddedEngine(tiny_gpt2)
        tok = eng.tokenizer = GatedTokenizer(eng.tokenizer, gated=True)
        async with in_process_server(eng) as (s, url):
            body = {"text": "What is 2 + 3?", "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
            gen = asyncio.ensure_future(_post(s, url + "/generate", body))
            assert await asyncio.to_thread(tok.entered.wait, 60)
            async with s.get(url + "/health") as r:
                health = r.status
            answered_while_tokenizing = not tok.returned.is_set()
            tok.release.set()
            return health, answered_while_tokenizing, await gen

    health, answered_while_tokenizing, (status, body) = run(go())
    assert health == 200 and answered_while_tokenizing
    assert status == 200 and len(body["output_ids"]) == 3


def test_oversized_prompts_are_refused_before_tokenizing(tiny_gpt2):
    # tiny tokenizer: longest vocabulary entry 13 bytes ('<|endoftext|>'), context 1024 -> a text over 13312
    # UTF-8 bytes has more tokens than the context; the body limit is 6 * 13312 + 64 KiB = 145408 bytes.
    async def go():
        eng = EmbeddedEngine(tiny_gpt2)
        tok = eng.tokenizer = GatedTokenizer(eng.tokenizer, gated=False)
        async with in_process_server(eng) as (s, url):
            huge = await _post(s, url + "/generate", {"text": "a" * 5_000_000})
            long = await _post(s, url + "/generate", {"text": "a" * 20_000})
            # The count is checked before any per-token work: the bad id at the end is never looked at.
            ids = await _post(s, url + "/generate", {"input_ids": [1] * 5000 + ["x"]})
            calls_after_refusals = tok.calls
            fits = await _post(s, url + "/generate", {"text": "a " * 100, "sampling_params": {"max_new_tokens": 2}})
            return huge, long, ids, calls_after_refusals, fits

    huge, long, ids, calls_after_refusals, fits = run(go())
    assert huge[0] == 413 and "request body exceeds the limit of 145408 bytes" in huge[1]["error"]["message"]
    assert long[0] == 400 and long[1]["error"]["message"].startswith(
        "text of 20000 UTF-8 bytes exceeds the limit of 13312 bytes"
    )
    assert ids[0] == 400 and "input_ids holds 5001 tokens; the model's context of 1024" in ids[1]["error"]["message"]
    assert calls_after_refusals == 0
    assert fits[0] == 200 and len(fits[1]["output_ids"]) == 2


# ---- /abort_request ------------------------------------------------------------------------------------


def test_abort_request_over_http_returns_the_tokens_so_far(tiny_gpt2, reference, teacher_forced):
    max_new = 50

    async def go():
        eng = GatedEngine(tiny_gpt2, max_batch_size=1)  # one slot: the last request is served only if it is freed
        eng.eos_ids = []
        async with in_process_server(eng) as (s, url):
            def gen(rid):
                body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": max_new}, "rid": rid,
                        "return_logprob": True}  # fmt: skip
                return asyncio.ensure_future(_post(s, url + "/generate", body))

            eng.block_at_step(5)
            victim = gen("victim")
            await eng.wait_blocked()  # the victim is mid-decode: 5 tokens so far, the worker inside step 5
            queued = gen("queued")
            await until(lambda: eng.num_in_flight == 2)
            aborts = []
            for body in ({"rid": "queued"}, {"rid": "victim", "abort_all": False}, {"rid": "nobody"}):
                async with s.post(url + "/abort_request", json=body) as r:
                    aborts.append((r.status, await r.read()))
            eng.release.set()
            return aborts, await victim, await queued, await gen("after")

    aborts, (v_status, victim), (q_status, queued), (a_status, after) = run(go())
    assert aborts == [(200, b"")] * 3  # SGLang answers 200 with no body, also for a rid not in flight
    meta = victim["meta_info"]
    # Aborted after the step it was in: 6 tokens (1 from the prefill, 5 decode steps), each with its logprob.
    assert v_status == 200
    assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert len(victim["output_ids"]) == len(meta["output_token_logprobs"]) == 6 < max_new
    lps = [item[0] for item in meta["output_token_logprobs"]]
    want = teacher_forced(reference, PROMPTS[1], victim["output_ids"], 1.0)
    assert max(abs(a - b) for a, b in zip(lps, want)) <= TOL
    assert q_status == 200 and queued["output_ids"] == []
    assert queued["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert a_status == 200 and len(after["output_ids"]) == max_new
    assert after["meta_info"]["finish_reason"] == {"type": "length", "length": max_new}


def test_a_client_timeout_aborts_the_generation_on_the_server(tiny_gpt2):
    # The SGLang client against `serve`: the request cannot finish (the worker is held mid-decode), the client's
    # timeout fires, and its /abort_request frees the server's only slot instead of leaving it generating 900
    # tokens for nobody.
    from rollshard.generate.engines.sglang import SGLangConfig, SGLangEngine

    async def go():
        eng = GatedEngine(tiny_gpt2, max_batch_size=1)
        eng.eos_ids = []
        aborted = []
        abort = eng.abort
        eng.abort = lambda rid: aborted.append(rid) or abort(rid)
        async with in_process_server(eng) as (_, url):
            cfg = SGLangConfig(request_timeout_s=0.2, max_retries=0)  # the gate holds: the timeout is certain
            client = SGLangEngine(url, config=cfg)
            eng.block_at_step(3)
            with pytest.raises(EngineError, match="request t-1: gave up after 1 attempts"):
                await client.generate(PROMPTS[0], SamplingParams(max_new_tokens=900), rid="t-1")
            await client.close()  # waits for the background /abort_request
            assert aborted == ["t-1"]
            eng.release.set()
            async with SGLangEngine(url) as again:  # the slot is free: the next request runs at once
                after = await again.generate(PROMPTS[0], SamplingParams(max_new_tokens=8))
            return after, len(eng.batch_sizes)

    after, steps = run(go())
    assert len(after.output_ids) == 8
    assert steps <= 3 + 8  # the aborted request stopped at the gate; it did not decode its 900 tokens


def test_the_body_limit_is_bounded_for_a_model_without_a_context_length():
    from rollshard.generate.server import MAX_BODY_BYTES, body_limit

    assert body_limit(1024, 13, 1024) == 145408  # the tiny model: a context's text, escaped, or its ids
    assert body_limit(1 << 30, 16, 151936) == MAX_BODY_BYTES == 64 * 1024**2  # no context length reported


# ---- return_sampling_mask, as SGLang 0.5.23 answers it ---------------------------------------------


def test_sampling_mask_fields_and_refusals_like_sglang(embedded_server):
    mask_body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"temperature": 1.0, "top_k": 5, "max_new_tokens": 4, "sampling_seed": 3},
        "return_logprob": True,
        "return_sampling_mask": True,
    }

    async def go():
        async with aiohttp.ClientSession() as s:
            out = [await _post(s, embedded_server + "/generate", mask_body)]
            top_p = {**mask_body, "sampling_params": {"temperature": 1.0, "top_p": 0.8, "max_new_tokens": 4}}
            out.append(await _post(s, embedded_server + "/generate", top_p))
            inside = {**mask_body, "sampling_params": {**mask_body["sampling_params"], "return_sampling_mask": True}}
            out.append(await _post(s, embedded_server + "/generate", inside))
            greedy = {**mask_body, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
            out.append(await _post(s, embedded_server + "/generate", greedy))
            async with s.get(embedded_server + "/get_server_info") as r:
                out.append((r.status, await r.json()))
        return out

    (st, body), (st_p, refused), (st_in, inside), (st_g, greedy), (st_info, info) = run(go())
    meta = body["meta_info"]
    assert st == 200 and meta["output_token_sampling_mask_length"] == 4
    masks, slps = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert [len(m) for m in masks] == [5] * 4 and all(t in m for t, m in zip(body["output_ids"], masks))
    assert all(lp[0] <= s <= 0 for lp, s in zip(meta["output_token_logprobs"], slps))
    # SGLang's refusal of a top-p without a top-k, its wording; the key belongs at the top level, not inside.
    assert st_p == 400 and refused["error"]["message"].startswith(
        "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= 4096; got top_k=1073741824"
    )
    assert st_in == 400 and "sampling_params.return_sampling_mask: not a sampling parameter" in inside["error"]["message"]
    assert st_g == 200 and greedy["meta_info"]["output_token_sampling_mask"] == [[t] for t in greedy["output_ids"]]
    assert greedy["meta_info"]["output_token_sampling_logprobs"] == [0.0, 0.0]
    assert st_info == 200 and info["sampling_mask_max_tokens"] == 4096


def test_sglang_client_gets_the_support_from_serve(embedded_server, reference, tf_logits):
    sp = SamplingParams(temperature=0.7, top_k=20, max_new_tokens=8, return_sampling_mask=True)

    async def go():
        async with make_engine(embedded_server) as eng:
            await eng.health_check(sp)  # serve reports its cap: the check runs and passes
            return await eng.generate(PROMPTS[1], sp, rid="support-1")

    res = run(go())
    logp = torch.log_softmax(tf_logits(reference, PROMPTS[1], res.output_ids) / 0.7, dim=-1)  # [R, V]
    for t, (tok, support, slp) in enumerate(zip(res.output_ids, res.sampling_support, res.sampling_logprobs)):
        assert set(support) == set(logp[t].topk(20).indices.tolist())
        assert abs(slp - float(logp[t, tok] - torch.logsumexp(logp[t, support], dim=0))) <= TOL


def test_info_answers_report_the_engine_busy_share(tiny_gpt2):
    async def go():
        engine = EmbeddedEngine(tiny_gpt2)
        # The worker answers a request inside its step and adds the step's time after: a gate for the step's end,
        # the worker's first wait for new requests after the answer arrived.
        answered, idle, real_drain = threading.Event(), threading.Event(), engine._drain

        def drain(block=False):
            if block and answered.is_set():
                idle.set()
            return real_drain(block)

        engine._drain = drain
        async with in_process_server(engine) as (s, url):

            async def info(path):
                async with s.get(url + path) as r:
                    return await r.json()

            before = await info("/get_model_info")
            body = {"input_ids": [1, 5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
            status, _ = await _post(s, url + "/generate", body)
            answered.set()
            assert await asyncio.get_running_loop().run_in_executor(None, idle.wait, 60)
            return before, status, await info("/get_model_info"), await info("/get_server_info")

    before, status, model_info, server_info = run(go())
    assert status == 200
    assert before["busy_seconds"] == 0.0 and before["uptime_seconds"] > 0  # no batch yet: the worker never ran
    for after in (model_info, server_info):
        assert isinstance(after["busy_seconds"], float) and isinstance(after["uptime_seconds"], float)
        assert 0 < after["busy_seconds"] <= after["uptime_seconds"]
    assert server_info["busy_seconds"] == model_info["busy_seconds"]  # nothing ran between the two answers

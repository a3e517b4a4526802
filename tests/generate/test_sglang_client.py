"""The SGLang client against scripted servers on 127.0.0.1: strict parsing, retries, fail-fast, load spreading."""

from __future__ import annotations

import asyncio

import pytest

from rollshard.generate.engines import EngineError, SamplingParams, make_engine
from rollshard.generate.engines.base import NEUTRAL_SAMPLING
from rollshard.generate.engines.sglang import SGLangConfig, SGLangEngine, backoff_delay, parse_response
from rollshard.store.schema import WeightSpan

from tests.generate.sglang_fakes import IDS, LPS, FakeSGLang, free_port, ok_body

FAST = dict(backoff_base_s=0.01, backoff_max_s=0.05, request_timeout_s=5.0)


def run(coro):
    return asyncio.run(coro)


async def one(fake_script, *, rid="req-1", config=None, **fake_kw):
    async with FakeSGLang(fake_script, **fake_kw) as fake:
        async with SGLangEngine(fake.url, config=config or SGLangConfig(max_retries=3, **FAST)) as eng:
            try:
                return (
                    await eng.generate([1, 2, 3, 4], SamplingParams(temperature=0.7, max_new_tokens=3), rid=rid),
                    fake,
                )
            except EngineError as e:
                return e, fake


# ---- parsing ------------------------------------------------------------------------------------


def test_request_shape_and_parsed_result():
    res, fake = run(one(["ok"]))
    assert fake.requests == [
        {
            "input_ids": [1, 2, 3, 4],
            "sampling_params": {
                "temperature": 0.7,
                "top_p": 1.0,
                "top_k": -1,
                "max_new_tokens": 3,
                "no_stop_trim": False,
                "skip_special_tokens": True,
                # Spelled out so neither the server's defaults nor its --preferred-sampling-params apply.
                "min_p": 0.0,
                "frequency_penalty": 0.0,
                "presence_penalty": 0.0,
                "repetition_penalty": 1.0,
                "min_new_tokens": 0,
            },
            "return_logprob": True,
            "logprob_start_len": -1,
            "rid": "req-1",
        }
    ]
    assert res.output_ids == IDS and res.logprobs == LPS and res.text == "abc"
    assert res.finish_reason == "length" and res.finish_detail == {"length": 3}
    assert res.weight_version == "3" and res.weight_versions == [WeightSpan(version="3", start=0, end=3)]
    assert res.prompt_tokens == 4 and res.completion_tokens == 3 and res.meta["id"] == "x"
    assert res.meta["weight_versions_sent"] is None  # the span above was made from weight_version


def test_neutral_sampling_is_sent_and_never_overrides_a_field():
    sent = SamplingParams(temperature=0.3, stop=["x"]).to_json()
    assert {k: sent[k] for k in NEUTRAL_SAMPLING} == NEUTRAL_SAMPLING
    assert sent["temperature"] == 0.3 and sent["stop"] == ["x"] and "sampling_seed" not in sent


def test_newer_server_fields_are_tolerated_and_spans_kept():
    body = ok_body(
        input_token_logprobs=[[None, 1, None]],
        weight_versions=[{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}],
        cached_tokens=2,
        e2e_latency=0.1,
        num_retractions=0,
        reasoning_tokens=0,
        output_token_logprobs_length=3,
        finish={"type": "stop", "matched": 13},
    )
    res = parse_response(body, rid="r")
    assert res.weight_versions == [WeightSpan(version="2", start=0, end=1), WeightSpan(version="3", start=1, end=3)]
    assert res.finish_reason == "stop" and res.finish_detail == {"matched": 13}
    assert res.meta["cached_tokens"] == 2 and "input_token_logprobs" not in res.meta
    assert res.meta["weight_versions_sent"] == body["meta_info"]["weight_versions"]


@pytest.mark.parametrize(
    "body, message",
    [
        (
            ok_body(lps=LPS[:2]),
            r"request r7: 2 logprobs for 3 response tokens .*refusing a response with missing logprobs",
        ),
        (
            {**ok_body(), "meta_info": {**ok_body()["meta_info"], "output_token_logprobs": None}},
            r"request r7: response has no meta_info.output_token_logprobs",
        ),
        (
            {**ok_body(), "output_ids": [11, 99, 13]},
            r"request r7: output_ids\[1\] = 99 but output_token_logprobs\[1\] names token 12",
        ),
        (ok_body(lps=[-0.5, float("nan"), -1.0]), r"request r7: logprob of response token 1 is nan"),
        (ok_body(lps=[-0.5, 0.3, -1.0]), r"request r7: logprob of response token 1 is 0.3"),
        (
            {**ok_body(), "meta_info": {**ok_body()["meta_info"], "finish_reason": None}},
            r"request r7: finish_reason None",
        ),
    ],
    ids=["short", "missing", "ids-disagree", "nan", "positive", "no-finish"],
)
def test_refuses_responses_without_matching_logprobs(body, message):
    with pytest.raises(EngineError, match=message):
        parse_response(body, rid="r7")


def test_refusal_over_http_names_the_request_and_is_not_retried():
    err, fake = run(one([ok_body(lps=LPS[:2])], rid="sample-9/turn0"))
    assert isinstance(err, EngineError) and "request sample-9/turn0: 2 logprobs for 3 response tokens" in str(err)
    assert len(fake.requests) == 1


def test_abort_keeps_the_tokens_that_have_logprobs():
    # A client's /abort_request: SGLang sends status_code null (FINISH_ABORT() without one).
    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    res = parse_response(ok_body(ids=[11, 12, 13], lps=[-0.5, -1.0], finish=finish), rid="r")
    assert res.finish_reason == "abort" and res.output_ids == [11, 12] and res.logprobs == [-0.5, -1.0]
    assert res.finish_detail == {"message": "Aborted", "status_code": None, "err_type": None}
    empty = {
        "text": "",
        "output_ids": [],
        "meta_info": {"finish_reason": finish, "prompt_tokens": 4, "completion_tokens": 0},
    }
    res = parse_response(empty, rid="r")
    assert res.output_ids == [] and res.logprobs == [] and res.finish_reason == "abort"


# ---- retries ------------------------------------------------------------------------------------


def test_recovers_from_5xx_and_dropped_connections_with_fresh_server_ids():
    res, fake = run(one([500, "drop", 503, "ok"]))
    assert res.output_ids == IDS and res.logprobs == LPS
    # SGLang aborts every rid that starts with an aborted one: a retry's id must not extend the one it replaces.
    assert [r["rid"] for r in fake.requests] == ["req-1", "retry1-req-1", "retry2-req-1", "retry3-req-1"]


def test_recovers_from_a_timeout():
    # The fake never answers the first attempt: the client's timeout is what ends it, at any machine speed.
    cfg = SGLangConfig(max_retries=2, backoff_base_s=0.01, backoff_max_s=0.05, request_timeout_s=0.5)
    res, fake = run(one(["hang", "ok"], config=cfg))
    assert res.output_ids == IDS and [r["rid"] for r in fake.requests] == ["req-1", "retry1-req-1"]
    assert fake.aborts == ["req-1"]  # the abandoned attempt is aborted on the server, the answered one is not


def test_gives_up_after_the_retry_limit_with_the_last_error():
    err, fake = run(one([], default=500))
    assert isinstance(err, EngineError)
    assert len(fake.requests) == 4  # 1 + max_retries 3
    assert str(err).startswith("request req-1: gave up after 4 attempts; last error: HTTP 500 from http://127.0.0.1:")
    assert "scripted 500" in str(err) and "\n" not in str(err)


def test_4xx_is_not_retried():
    err, fake = run(one([400, "ok"]))
    assert isinstance(err, EngineError) and len(fake.requests) == 1
    assert "request req-1: HTTP 400 from" in str(err) and "scripted 400" in str(err)


def test_backoff_is_exponential_jittered_and_capped():
    import random

    rng = random.Random(0)
    for attempt, step in enumerate([0.5, 1.0, 2.0, 4.0, 8.0, 8.0]):
        delays = [backoff_delay(attempt, 0.5, 8.0, rng) for _ in range(200)]
        assert step / 2 <= min(delays) and max(delays) <= step
        assert max(delays) - min(delays) > step / 4  # jittered, not constant


# ---- fail fast, spreading, bounds ---------------------------------------------------------------


def test_health_check_and_model_info_of_every_server():
    async def go():
        async with FakeSGLang() as a, FakeSGLang() as b:
            async with make_engine(f"{a.url},{b.url}") as eng:
                return await eng.health_check(), await eng.model_info()

    infos, info = run(go())
    assert infos == [{"model_path": "fake", "weight_version": "3"}] * 2 and info["weight_version"] == "3"


def test_least_in_flight_spreads_load_and_routes_around_a_dead_server():
    async def go():
        async with FakeSGLang(latency=0.2) as a, FakeSGLang(latency=0.2) as b:
            cfg = SGLangConfig(max_retries=2, **FAST)
            async with SGLangEngine([a.url, b.url], config=cfg) as eng:
                await asyncio.gather(*(eng.generate([1], SamplingParams()) for _ in range(10)))
                spread = (len(a.requests), len(b.requests))
            dead = f"http://127.0.0.1:{free_port()}"
            async with SGLangEngine([dead, b.url], config=cfg) as eng:
                results = await asyncio.gather(*(eng.generate([1], SamplingParams()) for _ in range(6)))
            return spread, results, len(b.requests)

    spread, results, b_total = run(go())
    assert spread == (5, 5)
    assert len(results) == 6 and all(r.output_ids == IDS for r in results)
    assert b_total == 10 // 2 + 6  # every request that hit the dead server was retried on the live one


def test_concurrency_is_bounded():
    async def go():
        async with FakeSGLang(latency=0.05) as fake:
            async with SGLangEngine(fake.url, config=SGLangConfig(max_concurrency=3, **FAST)) as eng:
                await asyncio.gather(*(eng.generate([1], SamplingParams()) for _ in range(12)))
            return fake.max_in_flight, len(fake.requests)

    assert run(go()) == (3, 12)


def test_make_engine_specs():
    eng = make_engine("http://a:1, http://b:2/")
    assert isinstance(eng, SGLangEngine) and eng.urls == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="neither 'embedded:PATH' nor a comma-separated list of http"):
        make_engine("localhost:30000")
    with pytest.raises(ValueError, match="needs a model folder"):
        make_engine("embedded:")


def test_abort_clips_weight_spans_and_text_to_the_kept_tokens():
    finish = {"type": "abort", "message": "aborted by the scheduler"}
    # 5 tokens sent, 3 with logprobs: spans [0, 2) v3, [2, 4) v4, [4, 5) v5 -> [0, 2) v3, [2, 3) v4; v5 dropped.
    body = ok_body(
        ids=[11, 12, 13, 14, 15], lps=[-0.5, -1.0, -0.25], finish=finish,
        weight_versions=[{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4},
                         {"version": "5", "start": 4, "end": 5}],
    )
    body["text"] = "abcde"
    body["meta_info"]["output_token_logprobs"] = [[-0.5, 11, "a"], [-1.0, 12, "b"], [-0.25, 13, "c"]]
    res = parse_response(body, rid="r")
    assert res.output_ids == [11, 12, 13] and res.logprobs == [-0.5, -1.0, -0.25]
    assert res.weight_versions == [WeightSpan(version="3", start=0, end=2), WeightSpan(version="4", start=2, end=3)]
    assert res.text == "abc"  # the kept tokens' own texts, not the server's "abcde"
    # Msgspec array form, a span starting exactly at the kept length, and no token texts: text is dropped.
    body = ok_body(ids=[11, 12, 13, 14], lps=[-0.5, -1.0], finish=finish, weight_versions=[["3", 0, 2], ["4", 2, 4]])
    res = parse_response(body, rid="r")
    assert res.weight_versions == [WeightSpan(version="3", start=0, end=2)] and res.text == ""
    # One version per sent token (4), 2 kept: ["3", "4", "4", "5"] -> [0, 1) v3, [1, 2) v4.
    body = ok_body(ids=[11, 12, 13, 14], lps=[-0.5, -1.0], finish=finish, weight_versions=["3", "4", "4", "5"])
    res = parse_response(body, rid="r")
    assert res.weight_versions == [WeightSpan(version="3", start=0, end=1), WeightSpan(version="4", start=1, end=2)]
    # Nothing cut: the server's text and spans stay as they are.
    body = ok_body(finish=finish, weight_versions=[["3", 0, 3]])
    res = parse_response(body, rid="r")
    assert res.text == "abc" and res.weight_versions == [WeightSpan(version="3", start=0, end=3)]

"""The SGLang client against scripted servers on 127.0.0.1: strict parsing, retries, fail-fast, load spreading."""

from __future__ import annotations

import asyncio

import pytest

from rollshard.generate.engines import EngineError, SamplingParams, make_engine
from rollshard.generate.engines.base import EngineSettingsError
from rollshard.generate.engines.base import NEUTRAL_SAMPLING
from rollshard.generate.engines.sglang import SGLangConfig, SGLangEngine, parse_response
from rollshard.store.format.schema import WeightSpan

from tests.generate.sglang_fakes import IDS, LPS, FakeSGLang, free_port, ok_body, with_support

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
                "ignore_eos": False,
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


def test_ignore_eos_is_sent_in_sampling_params():
    async def go():
        async with FakeSGLang(["ok"]) as fake:
            async with SGLangEngine(fake.url, config=SGLangConfig(**FAST)) as eng:
                await eng.generate([1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True), rid="r")
            return fake

    assert run(go()).requests[0]["sampling_params"]["ignore_eos"] is True


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
    # The fake never answers the first attempt: the client's timeout is what ends it, at any machine speed. The
    # answered attempt must fit in the same timeout: 3 s leaves a loaded machine room (0.5 s failed under load).
    cfg = SGLangConfig(max_retries=2, backoff_base_s=0.01, backoff_max_s=0.05, request_timeout_s=3.0)
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
    """The client's retry wait (store's backoff_delay, with SGLangConfig's base and cap)."""
    import random

    from rollshard.store.common import backoff_delay

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


# ---- sampling support (return_sampling_mask) ------------------------------------------------------

# SGLang 0.5.23's shapes (measured): one id list per output token, the token among them (descending
# probability), and the sampled token's logprob under the renormalized support (>= the full logprob).
SUPPORTS = [[11, 40, 7], [12, 11], [5, 13, 9, 1]]
SAMPLING_LPS = [-0.25, -0.5, -1.5]
ASK = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=3, return_sampling_mask=True)


def supported_body(supports=SUPPORTS, sampling_lps=SAMPLING_LPS, **kw):
    return with_support(ok_body(**kw), supports, sampling_lps)


async def ask(script, sampling=ASK, **fake_kw):
    async with FakeSGLang(script, **fake_kw) as fake:
        async with SGLangEngine(fake.url, config=SGLangConfig(max_retries=0, **FAST)) as eng:
            try:
                return await eng.generate([1, 2, 3, 4], sampling, rid="req-1"), fake
            except EngineError as e:
                return e, fake


def test_sampling_mask_is_sent_top_level_and_both_fields_parsed():
    res, fake = run(ask([supported_body()]))
    (sent,) = fake.requests
    assert sent["return_sampling_mask"] is True and "return_sampling_mask" not in sent["sampling_params"]
    assert res.sampling_support == SUPPORTS and res.sampling_logprobs == SAMPLING_LPS
    assert "output_token_sampling_mask" not in res.meta  # parsed, not duplicated into meta
    # Not asked: nothing is sent, and whatever the server sends is not taken.
    res, fake = run(ask([supported_body()], sampling=SamplingParams(temperature=0.7, top_k=5, max_new_tokens=3)))
    assert "return_sampling_mask" not in fake.requests[0]
    assert res.sampling_support is None and res.sampling_logprobs is None


def _without(key):
    body = supported_body()
    del body["meta_info"][key]
    return body


@pytest.mark.parametrize(
    "body, message",
    [
        (_without("output_token_sampling_mask"), r"response has no meta_info.output_token_sampling_mask"),
        (_without("output_token_sampling_logprobs"), r"response has no meta_info.output_token_sampling_mask"),
        (supported_body(supports=SUPPORTS[:2]), r"2 sampling supports and 3 sampling logprobs for 3 response tokens"),
        (supported_body(supports=[[11], [40, 7], [13]]), r"response token 1 \(id 12\) is not in its sampling support"),
        # A boolean mask over the vocabulary is not what SGLang sends (measured: ids); refused, not misread.
        (supported_body(supports=[[True, False]] * 3), r"sampling support of response token 0 is \[True, False\]"),
        (supported_body(supports=[[11, 11], [12], [13]]), r"sampling support of response token 0 names an id twice"),
        (supported_body(sampling_lps=[-0.25, float("nan"), -1.5]), r"sampling logprob of response token 1 is nan"),
        (supported_body(sampling_lps=[-0.25, 0.01, -1.5]), r"sampling logprob of response token 1 is 0.01"),
        # Below the full logprob (-2.0) by more than the tolerance: truncation cannot lower a probability.
        (supported_body(sampling_lps=[-0.25, -0.5, -2.01]), r"sampling logprob of response token 2 is -2.01 with full"),
        (supported_body(sampling_lps=[-0.25, None, -1.5]), r"sampling logprob of response token 1 is None"),
    ],
    ids=["no-mask", "no-logprobs", "short", "outside", "boolean-mask", "duplicate", "nan", "positive", "below-full",
         "null"],
)
def test_refuses_responses_without_a_matching_sampling_support(body, message):
    with pytest.raises(EngineError, match=r"request r7: " + message):
        parse_response(body, rid="r7", sampling_mask=True)


def test_sampling_logprob_rounding_is_tolerated_and_clamped_like_logprobs():
    # fp32 rounding: a hair above 0 is stored as 0.0; a hair (< 1e-4) below the full logprob is kept as sent.
    res = parse_response(supported_body(sampling_lps=[3e-5, -0.5, -2.00005]), rid="r", sampling_mask=True)
    assert res.sampling_logprobs == [0.0, -0.5, -2.00005]


def test_a_response_without_the_support_is_refused_over_http_naming_the_request():
    err, fake = run(ask([ok_body()]))
    assert isinstance(err, EngineError) and str(err).startswith("request req-1: response has no meta_info.output_token")
    assert len(fake.requests) == 1  # the server answered: not a transport error to retry here (the runner retries)


def test_abort_keeps_the_prefix_that_has_ids_logprobs_and_supports():
    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    # 3 ids and logprobs, 2 supports: the third token is dropped with everything else of it.
    body = supported_body(supports=SUPPORTS[:2], sampling_lps=SAMPLING_LPS[:2], finish=finish)
    res = parse_response(body, rid="r", sampling_mask=True)
    assert res.output_ids == IDS[:2] and res.logprobs == LPS[:2]
    assert res.sampling_support == SUPPORTS[:2] and res.sampling_logprobs == SAMPLING_LPS[:2]
    # 3 ids and supports, 2 logprobs: the supports are cut to the 2 tokens kept.
    body = supported_body(finish=finish)
    body["meta_info"]["output_token_logprobs"] = body["meta_info"]["output_token_logprobs"][:2]
    res = parse_response(body, rid="r", sampling_mask=True)
    assert res.output_ids == IDS[:2] and res.sampling_support == SUPPORTS[:2] and res.sampling_logprobs == SAMPLING_LPS[:2]
    # An abort before any token: nothing at all, the support fields empty (not missing).
    empty = with_support(ok_body(ids=[], lps=[], finish=finish), [], [])
    del empty["meta_info"]["output_token_sampling_mask"]
    res = parse_response(empty, rid="r", sampling_mask=True)
    assert res.output_ids == [] and res.sampling_support == [] and res.sampling_logprobs == []


def test_a_retried_request_gets_the_support_of_the_attempt_that_answered():
    async def go():
        async with FakeSGLang([503, supported_body()]) as fake:
            async with SGLangEngine(fake.url, config=SGLangConfig(max_retries=2, **FAST)) as eng:
                return await eng.generate([1, 2], ASK, rid="r"), fake

    res, fake = run(go())
    assert [r["rid"] for r in fake.requests] == ["r", "retry1-r"] and all(r["return_sampling_mask"] for r in fake.requests)
    assert res.sampling_support == SUPPORTS and len(res.sampling_support) == len(res.output_ids)


@pytest.mark.parametrize(
    "sampling, problem",
    [
        (SamplingParams(top_k=5000, return_sampling_mask=True), "this run has --top-k 5000; add --top-k K (K <= 4096)"),
        (SamplingParams(top_p=0.9, return_sampling_mask=True), "this run has no --top-k; add --top-k K (K <= 4096)"),
        (SamplingParams(top_k=4096, return_sampling_mask=True), None),
        (SamplingParams(temperature=0.0, return_sampling_mask=True), None),  # greedy: SGLang runs it as top_k 1
    ],
)
def test_health_check_refuses_a_top_k_over_the_servers_cap(sampling, problem):
    async def go(server_info):
        async with FakeSGLang(server_info=server_info) as fake:
            async with SGLangEngine(fake.url, config=SGLangConfig(max_retries=0, **FAST)) as eng:
                try:
                    return await eng.health_check(sampling)
                except EngineSettingsError as e:
                    return e

    out = run(go({"sampling_mask_max_tokens": 4096}))
    if problem is None:
        assert isinstance(out, list)
    else:
        assert isinstance(out, EngineSettingsError) and "refuses return_sampling_mask here" in str(out)
        assert problem in str(out) and "or pass --sampling-support off" in str(out)
    assert isinstance(run(go(None)), list)  # a server that does not report its cap (404) is not checked here
    raised = run(go({"sampling_mask_max_tokens": 8192}))
    assert isinstance(raised, list) or "no --top-k" in str(raised)  # a raised cap admits top_k 5000

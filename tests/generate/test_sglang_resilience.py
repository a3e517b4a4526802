"""The SGLang client when servers misbehave: transient aborts, abandoned attempts, dead servers, health, preferences.

Against scripted servers on 127.0.0.1 (tests/generate/sglang_fakes.py). Nothing here waits for a
duration and then asserts: a fake that never answers makes a client timeout certain, and counts of
requests seen are checked, not clocks.
"""

from __future__ import annotations

import asyncio

import pytest

from rollshard.generate.engines import EngineError, SamplingParams, make_engine
from rollshard.generate.engines import sglang as sglang_module
from rollshard.generate.engines.base import EngineUnavailableError
from rollshard.generate.engines.sglang import SGLangConfig, SGLangEngine, parse_response
from rollshard.generate.engines.sglang_protocol import TransientAbortError, preferred_sampling_differences

from tests.generate.sglang_fakes import IDS, FakeSGLang, SlammingDoor, free_port, ok_body

FAST = dict(backoff_base_s=0.01, backoff_max_s=0.05, request_timeout_s=5.0)
RETRACTED = "Retracted under decode memory pressure without a KV backup. Retry later."


def run(coro):
    return asyncio.run(coro)


def abort_body(status_code, message="Aborted", err_type=None):
    finish = {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}
    return ok_body(ids=[11], lps=[-0.5], finish=finish)


async def generate_once(fake, cfg, rid="req-1"):
    async with SGLangEngine(fake.url, config=cfg) as eng:
        try:
            return await eng.generate([1, 2], SamplingParams(max_new_tokens=3), rid=rid)
        except EngineError as e:
            return e


# ---- aborts with a 5xx status code are transient ----------------------------------------------------


@pytest.mark.parametrize("status_code", [500, 503])
def test_a_5xx_abort_is_raised_as_transient_by_the_parser(status_code):
    with pytest.raises(TransientAbortError) as e:
        parse_response(abort_body(status_code, RETRACTED), rid="r1")
    assert e.value.status_code == status_code
    assert str(e.value) == f"request r1: the server aborted it with status_code {status_code} ({RETRACTED})"


@pytest.mark.parametrize("status_code", [None, 400])
def test_client_requested_and_4xx_aborts_are_final_results(status_code):
    res = parse_response(abort_body(status_code), rid="r1")
    assert res.finish_reason == "abort" and res.output_ids == [11] and res.finish_detail["status_code"] == status_code


def test_a_5xx_abort_is_retried_and_the_retry_answers():
    async def go():
        async with FakeSGLang([abort_body(503, RETRACTED), "ok"]) as fake:
            return await generate_once(fake, SGLangConfig(max_retries=3, **FAST)), fake

    res, fake = run(go())
    assert res.finish_reason == "length" and res.output_ids == IDS
    assert [r["rid"] for r in fake.requests] == ["req-1", "retry1-req-1"]
    assert fake.aborts == []  # the server finished the aborted attempt itself


def test_a_5xx_abort_exhausted_fails_with_one_line_and_a_final_abort_is_not_retried():
    async def go():
        async with FakeSGLang(default=abort_body(503, RETRACTED)) as fake:
            err = await generate_once(fake, SGLangConfig(max_retries=3, **FAST))
        async with FakeSGLang(default=abort_body(None)) as final:
            res = await generate_once(final, SGLangConfig(max_retries=3, **FAST))
        return err, fake, res, final

    err, fake, res, final = run(go())
    assert type(err) is EngineError and len(fake.requests) == 4
    assert str(err) == (
        f"request req-1: gave up after 4 attempts; last error: {fake.url}/generate aborted it with "
        f"status_code 503 ({RETRACTED})"
    )
    assert res.finish_reason == "abort" and len(final.requests) == 1


# ---- abandoned attempts are aborted on their server ----------------------------------------------------


def test_timed_out_attempts_are_aborted_on_the_server_each_went_to():
    async def go():
        async with FakeSGLang(default="hang") as a, FakeSGLang(default="hang") as b:
            cfg = SGLangConfig(max_retries=1, backoff_base_s=0.01, backoff_max_s=0.05, request_timeout_s=0.2)
            eng = SGLangEngine([a.url, b.url], config=cfg)
            try:
                err = None
                await eng.generate([1, 2], SamplingParams(), rid="req-1")
            except EngineError as e:
                err = e
            finally:
                await eng.close()
            return err, a, b

    err, a, b = run(go())
    assert "request req-1: gave up after 2 attempts; last error: TimeoutError talking to" in str(err)
    for fake in (a, b):  # one attempt on each (a retry avoids the server that failed), each aborted there
        assert fake.aborts == [r["rid"] for r in fake.requests] and len(fake.requests) == 1
    assert sorted(a.aborts + b.aborts) == ["req-1", "retry1-req-1"]


@pytest.mark.parametrize("how", ["cancel", "wait_for"])
def test_a_cancelled_request_is_aborted_before_close_returns(how):
    async def go():
        async with FakeSGLang(default="hang") as fake:
            eng = SGLangEngine(fake.url, config=SGLangConfig(**FAST))
            task = asyncio.ensure_future(eng.generate([1, 2], SamplingParams(), rid="req-1"))
            deadline = asyncio.get_running_loop().time() + 60
            while not fake.requests:  # the request has reached the server
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            if how == "cancel":  # Ctrl-C cancels the run's tasks
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:  # a caller's own timeout (the runner's GatedEngine) cancels it the same way
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(task, 0.05)
            await eng.close()
            return fake.aborts

    assert run(go()) == ["req-1"]


@pytest.mark.parametrize("abort_action", [500, "hang"])
def test_a_failing_abort_never_masks_the_original_error(abort_action):
    async def go():
        async with FakeSGLang(default="hang", abort_action=abort_action) as fake:
            cfg = SGLangConfig(max_retries=0, request_timeout_s=0.2, abort_timeout_s=0.2)
            err = await generate_once(fake, cfg)  # close() inside waits for the abort, bounded
            return err, fake

    err, fake = run(go())
    assert str(err).startswith("request req-1: gave up after 1 attempts; last error: TimeoutError talking to")
    assert fake.aborts == ["req-1"]


def test_answered_and_dropped_attempts_are_not_aborted():
    async def go():
        async with FakeSGLang([500, "drop", "ok"]) as fake:
            return await generate_once(fake, SGLangConfig(max_retries=3, **FAST)), fake

    res, fake = run(go())
    assert res.output_ids == IDS and len(fake.requests) == 3 and fake.aborts == []


# ---- circuit breaker ----------------------------------------------------------------------------------


def count_generate_posts(eng: SGLangEngine) -> list[str]:
    """Every /generate attempt the engine makes, by URL (a spy on its one-attempt method)."""
    seen: list[str] = []
    post = eng._post

    async def spy(url, path, payload, timeout):
        if path == "/generate":
            seen.append(url)
        return await post(url, path, payload, timeout)

    eng._post = spy
    return seen


def watch_backoffs(monkeypatch) -> tuple[list[SGLangEngine], list[bool]]:
    """Record, for every backoff sleep, whether the breaker of ``engines[0]`` (appended by the test) was open."""
    engines: list[SGLangEngine] = []
    sleeps_while_open: list[bool] = []
    backoff = sglang_module.backoff_delay

    def watched_backoff(*args):
        sleeps_while_open.append(engines[0].breaker.open)
        return backoff(*args)

    monkeypatch.setattr(sglang_module, "backoff_delay", watched_backoff)
    return engines, sleeps_while_open


def test_breaker_bounds_attempts_once_the_server_dies_and_stops_every_later_request(monkeypatch):
    threshold, concurrency, requests = 4, 8, 40
    cfg = SGLangConfig(max_retries=4, max_concurrency=concurrency, breaker_threshold=threshold, **FAST)
    engines, sleeps_while_open = watch_backoffs(monkeypatch)

    async def go():
        async with FakeSGLang() as fake:
            async with SGLangEngine(fake.url, config=cfg) as eng:
                engines.append(eng)
                served = await asyncio.gather(*(eng.generate([1], SamplingParams()) for _ in range(5)))
                await fake.stop()  # the server dies mid-run: its connections close, new ones are refused
                attempts = count_generate_posts(eng)
                results = await asyncio.gather(
                    *(eng.generate([1], SamplingParams()) for _ in range(requests)), return_exceptions=True
                )
                after_trip = len(attempts)
                with pytest.raises(EngineUnavailableError) as later:
                    await eng.generate([1], SamplingParams())
                return fake.url, served, results, after_trip, len(attempts), later.value

    url, served, results, after_trip, total, later = run(go())
    assert all(r.output_ids == IDS for r in served)
    assert all(isinstance(r, EngineUnavailableError) for r in results), {type(r).__name__ for r in results}
    # Without the breaker: requests * (max_retries + 1) = 200 attempts. With it: the threshold, plus the
    # requests already in flight when it opened.
    assert threshold <= after_trip <= threshold + concurrency
    assert total == after_trip  # the later request was refused without being sent
    assert sleeps_while_open and not any(sleeps_while_open)  # nobody slept a backoff once it was open
    msg = str(later)
    assert msg.startswith(f"SGLang server {url} unavailable: ") and " connection failures in a row, the last: " in msg
    assert msg.endswith("; restart the server and rerun") and "\n" not in msg
    assert all(str(r).startswith(f"SGLang server {url} unavailable: ") for r in results)


def test_a_request_failing_after_the_breaker_opened_elsewhere_raises_without_a_backoff(monkeypatch):
    # Request A is in flight when the server starts dropping connections; B's drops open the breaker; only
    # then does A fail (a broken answer, not a connection failure): A must not sleep a backoff first.
    engines, sleeps_while_open = watch_backoffs(monkeypatch)

    async def go():
        async with FakeSGLang(["broken"], default="drop") as fake:
            async with SGLangEngine(fake.url, config=SGLangConfig(max_retries=4, breaker_threshold=3, **FAST)) as eng:
                engines.append(eng)
                a = asyncio.ensure_future(eng.generate([1], SamplingParams(), rid="a"))
                deadline = asyncio.get_running_loop().time() + 60
                while not fake.requests:  # A has reached the server (and waits there for the gate)
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.01)
                with pytest.raises(EngineUnavailableError):
                    await eng.generate([1], SamplingParams(), rid="b")
                sleeps_before = len(sleeps_while_open)
                fake.gate.set()
                with pytest.raises(EngineUnavailableError):
                    await a
                return [r["rid"] for r in fake.requests], sleeps_before

    rids, sleeps_before = run(go())
    assert rids == ["a", "b", "retry1-b", "retry2-b"]  # A was not resent
    assert sleeps_before == 2 and sleeps_while_open == [False, False]  # B's two backoffs, none for A


def test_breaker_counts_failures_in_a_row_5xx_are_alive_and_health_check_closes_it():
    cfg = SGLangConfig(max_retries=4, breaker_threshold=3, **FAST)

    async def go():
        # Two failures, an answer, two failures, an answer: never three in a row. 5xx answers never count.
        async with FakeSGLang(["drop", "drop", "ok", "drop", 500, "drop", "ok", 503, 503, 503, 503, "ok"]) as fake:
            async with SGLangEngine(fake.url, config=cfg) as eng:
                ok = [await eng.generate([1], SamplingParams()) for _ in range(3)]
                seen_ok = len(fake.requests)
                fake.default = "drop"  # now every attempt dies: three in a row open the breaker
                with pytest.raises(EngineUnavailableError) as tripped:
                    await eng.generate([1], SamplingParams())
                seen_tripped = len(fake.requests)
                fake.default = "ok"  # the server is back, but an open breaker sends nothing
                with pytest.raises(EngineUnavailableError):
                    await eng.generate([1], SamplingParams())
                seen_open = len(fake.requests)
                await eng.health_check()  # ... until a health check sees it answer
                back = await eng.generate([1], SamplingParams())
                return ok, seen_ok, tripped.value, seen_tripped, seen_open, back, len(fake.requests)

    ok, seen_ok, tripped, seen_tripped, seen_open, back, seen_back = run(go())
    assert all(r.output_ids == IDS for r in ok) and seen_ok == 12
    assert seen_tripped == seen_ok + 3 and seen_open == seen_tripped
    assert "3 connection failures in a row, the last: ServerDisconnectedError" in str(tripped)
    assert back.output_ids == IDS and seen_back == seen_open + 1


def test_one_dead_server_among_live_ones_never_trips_the_breaker():
    # Many requests fail on the dead server at once, far more than the threshold in a row, while the
    # live one is still answering: per-server counts keep the run going.
    async def go():
        async with FakeSGLang(latency=0.05) as live:
            dead = f"http://127.0.0.1:{free_port()}"
            cfg = SGLangConfig(max_retries=2, breaker_threshold=2, **FAST)
            async with SGLangEngine([dead, live.url], config=cfg) as eng:
                attempts = count_generate_posts(eng)
                results = await asyncio.gather(*(eng.generate([1], SamplingParams()) for _ in range(20)))
            return results, attempts.count(dead), dead

    results, on_dead, dead = run(go())
    assert len(results) == 20 and all(r.output_ids == IDS for r in results)
    assert on_dead > 2  # the dead server did fail more often in a row than the threshold


def test_requests_go_to_the_live_server_once_the_other_refused():
    # A refusing server fails at once, so by load alone it would always look free and take every other first
    # attempt (each then paying a backoff). After its first failure it counts as loaded; it gets traffic only
    # when the live one is busier than a fair share.
    async def go():
        async with FakeSGLang() as live:
            dead = f"http://127.0.0.1:{free_port()}"
            cfg = SGLangConfig(max_concurrency=8, breaker_threshold=100, **FAST)
            async with SGLangEngine([dead, live.url], config=cfg) as eng:
                attempts = count_generate_posts(eng)
                for _ in range(20):  # one at a time: the load of both servers is 0 at every pick
                    assert (await eng.generate([1], SamplingParams())).output_ids == IDS
            return attempts.count(dead), len(live.requests)

    on_dead, on_live = run(go())
    assert on_dead <= 1 and on_live == 20


def test_all_servers_dead_open_the_breaker_naming_them():
    async def go():
        dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        cfg = SGLangConfig(max_retries=10, breaker_threshold=3, **FAST)
        async with SGLangEngine(dead, config=cfg) as eng:
            attempts = count_generate_posts(eng)
            with pytest.raises(EngineUnavailableError) as e:
                await eng.generate([1], SamplingParams())
        return dead, attempts, str(e.value)

    dead, attempts, msg = run(go())
    assert len(attempts) == 6 and attempts.count(dead[0]) == attempts.count(dead[1]) == 3  # < 11 attempts
    assert msg.startswith(f"SGLang servers {dead[0]}, {dead[1]} unavailable: 6 connection failures in a row")
    assert "the last: ClientConnectorError talking to http://127.0.0.1:" in msg


# ---- health check retries ------------------------------------------------------------------------------


def test_health_check_waits_through_503s_while_the_server_starts():
    async def go():
        async with FakeSGLang(health_script=[503, 503]) as fake:
            async with make_engine(fake.url, config=SGLangConfig(**FAST)) as eng:
                return await eng.health_check(), fake.health_requests

    infos, health_requests = run(go())
    assert infos == [{"model_path": "fake", "weight_version": "3"}] and health_requests == 3


def test_health_check_gives_up_after_the_retries_with_one_line():
    cfg = SGLangConfig(max_retries=3, **FAST)

    async def go():
        async with FakeSGLang(health_script=[503] * 10) as fake, SlammingDoor() as door:
            async with SGLangEngine(fake.url, config=cfg) as eng:
                with pytest.raises(EngineError) as sick:
                    await eng.health_check()
            async with SGLangEngine(door.url, config=cfg) as eng:
                with pytest.raises(EngineError) as slammed:
                    await eng.health_check()
            refused = f"http://127.0.0.1:{free_port()}"
            async with SGLangEngine(refused, config=cfg) as eng:
                with pytest.raises(EngineError) as dead:
                    await eng.health_check()
            return fake, sick.value, door, slammed.value, refused, dead.value

    fake, sick, door, slammed, refused, dead = run(go())
    # 1 + max_retries 3 attempts each; aiohttp itself resends an idempotent GET once when the server
    # disconnects (RFC 9112 "retrying requests"), so the door sees two connections per attempt.
    assert fake.health_requests == 4 and door.connections == 2 * 4
    assert str(sick) == (
        f"SGLang server {fake.url} is not healthy: GET /health answered HTTP 503 4 times, the last: scripted 503; "
        "wait until it has started, or restart it"
    )
    assert str(slammed).startswith(f"SGLang server {door.url} unreachable after 4 attempts (GET /health: ")
    msg = str(dead)
    assert msg.startswith(f"SGLang server {refused} unreachable after 4 attempts (GET /health: ClientConnectorError")
    assert msg.endswith("); start it or fix the URL") and "\n" not in msg


@pytest.mark.parametrize(
    "health, info, message",
    [
        ([404], None, r"GET /health answered HTTP 404: scripted 404; check that the URL points at an SGLang server"),
        ([], b"<html>", r"GET /get_model_info answered non-JSON: <html>; check that the URL points at an SGLang"),
        ([], b"[1]", r"GET /get_model_info answered list, not a JSON object"),
    ],
    ids=["4xx", "non-json", "not-an-object"],
)
def test_health_check_fails_at_once_on_a_4xx_or_a_bad_model_info(health, info, message):
    async def go():
        async with FakeSGLang(health_script=health, info=info) as fake:
            async with SGLangEngine(fake.url, config=SGLangConfig(max_retries=3, **FAST)) as eng:
                with pytest.raises(EngineError, match=message) as e:
                    await eng.health_check()
            return fake, str(e.value)

    fake, msg = run(go())
    assert fake.health_requests + fake.info_requests == 1 + (info is not None)  # not retried
    assert msg.startswith(f"SGLang server {fake.url}") and "\n" not in msg


# ---- preferred sampling params ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preferred",
    [None, "{}", {}, {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0, "min_p": 0}, '{"top_k": -1}',
     {"temperature": 0.7, "repetition_penalty": 1.1, "max_new_tokens": 64, "ignore_eos": True}],
    ids=["none", "empty-string", "empty", "equal", "equal-string", "overridden"],  # the client sends every one
)
def test_a_server_without_effective_preferred_sampling_params_passes(preferred):
    async def go():
        info = {"model_path": "fake", "preferred_sampling_params": preferred}
        async with FakeSGLang(info=info) as fake:
            async with SGLangEngine(fake.url, config=SGLangConfig(**FAST)) as eng:
                return await eng.health_check()

    assert run(go())[0]["preferred_sampling_params"] == preferred


@pytest.mark.parametrize(
    "preferred, sampling, diff",
    [
        ('{"stop": ["\\n"]}', None, "stop=['\\n'] (client sends none)"),
        ({"stop_regex": "x+"}, None, "stop_regex='x+' (client sends none)"),
        ({"temperature": 0.5, "regex": "[0-9]+"}, SamplingParams(temperature=0.5), "regex='[0-9]+' (client sends none)"),
    ],
    ids=["stop-json-string", "unknown-key", "request-sampling"],
)
def test_a_server_with_preferred_sampling_params_is_refused(preferred, sampling, diff):
    async def go():
        info = {"model_path": "fake", "preferred_sampling_params": preferred}
        async with FakeSGLang(info=info) as fake:
            async with SGLangEngine(fake.url, config=SGLangConfig(**FAST)) as eng:
                with pytest.raises(EngineError) as e:
                    await eng.health_check(sampling)
            return fake.url, str(e.value)

    url, msg = run(go())
    assert msg == (
        f"SGLang server {url} has --preferred-sampling-params that change what this client samples: {diff}; "
        "restart it without --preferred-sampling-params"
    )


def test_preferred_sampling_params_equal_to_the_request_pass_and_garbage_is_refused():
    sp = SamplingParams(temperature=0.7, stop=["x"])
    assert preferred_sampling_differences({"temperature": 0.7, "stop": ["x"], "min_new_tokens": 0}, sp) == []
    assert preferred_sampling_differences("not json", sp) is None
    assert preferred_sampling_differences([1], sp) is None


def test_close_with_a_request_in_flight_opens_no_new_session():
    # The in-flight request loses its connection when close() closes the session; its retry must not open a new
    # session behind close()'s back (nobody would close it), and no abort is sent through one.
    async def go():
        async with FakeSGLang(default="hang") as fake:
            eng = SGLangEngine(fake.url, config=SGLangConfig(**FAST))
            task = asyncio.ensure_future(eng.generate([1, 2], SamplingParams(), rid="r1"))
            deadline = asyncio.get_running_loop().time() + 60
            while not fake.requests:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            await eng.close()
            with pytest.raises(EngineError) as e:
                await task
            return str(e.value), eng._session, [r["rid"] for r in fake.requests]

    message, session, rids = run(go())
    assert session is None and rids == ["r1"]  # no retry reached the server
    assert "closed" in message

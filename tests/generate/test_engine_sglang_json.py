"""The SGLang client's JSON (orjson where installed): what orjson refuses and json reads still gets the
response checks' own errors, not a retried "non-JSON answer"."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollshard.generate.engines import EngineError, SamplingParams
from rollshard.generate.engines.sglang import SGLangConfig, SGLangEngine
from rollshard.generate.engines.sglang_protocol import decode_json, encode_json

from tests.generate.sglang_fakes import FakeSGLang, ok_body

FAST = dict(backoff_base_s=0.01, backoff_max_s=0.05, request_timeout_s=5.0, max_retries=3)


def test_encode_and_decode_round_trip_what_json_does():
    payload = {"input_ids": [1, 2, 2**70], "sampling_params": {"temperature": 0.7, "stop": ["é\n"]}}
    assert json.loads(encode_json(payload)) == payload  # 2**70: beyond orjson's integers, json writes it
    body = b'{"a": [NaN, Infinity, -1.5, 123456789012345678901234567890], "b": null}'
    decoded = decode_json(body)
    assert decoded["a"][2:] == [-1.5, 123456789012345678901234567890] and decoded["b"] is None
    assert decoded["a"][0] != decoded["a"][0] and decoded["a"][1] == float("inf")
    with pytest.raises(ValueError):
        decode_json(b"{not json")


def test_a_nan_logprob_over_http_is_refused_by_name_and_not_retried():
    async def go():
        # json.dumps writes the NaN literal, as a Python server would; orjson alone refuses to read it.
        async with FakeSGLang([ok_body(lps=[-0.5, float("nan"), -1.0])]) as fake:
            async with SGLangEngine(fake.url, config=SGLangConfig(**FAST)) as eng:
                with pytest.raises(EngineError) as e:
                    await eng.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=3), rid="r-nan")
                return str(e.value), len(fake.requests)

    message, requests = asyncio.run(go())
    assert "request r-nan: logprob of response token 1 is nan" in message and requests == 1

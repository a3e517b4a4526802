"""Routed experts at generation: the embedded engine's capture, SGLang's wire format (serve answers it as SGLang 0.5.23
does), multi-turn concatenation, and ``rollshard-generate --routed-experts``."""

from __future__ import annotations

import asyncio
import base64
import subprocess

import aiohttp
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from aiohttp.test_utils import TestServer

from rollshard.generate.agents.base import AgentCall
from rollshard.generate.engines import EngineError, SamplingParams
from rollshard.generate.engines.base import GenerateResult
from rollshard.generate.engines.embedded import EmbeddedEngine
from rollshard.generate.engines.routing import RoutingCapture
from rollshard.generate.engines.sglang_protocol import parse_response
from rollshard.generate.server import Server
from rollshard.store.format.routing import RoutingShape
from tests import forked

SHAPE = RoutingShape(layers=2, top_k=2, experts=4)
PROMPTS = [[1, 5, 6, 7, 8], [3, 4, 9], [1, 5, 6, 7, 8]]  # the first and last: one prefill, two samples


def _full_forward_routing(engine: EmbeddedEngine, ids: list[int]) -> np.ndarray:  # [len(ids), L, K]
    capture = RoutingCapture(engine.model)
    capture.on = True
    with torch.no_grad():
        engine.model(input_ids=torch.tensor([ids]))
    out = capture.take().numpy()
    capture.remove()
    return out


def test_embedded_engine_captures_every_forwarded_position(tiny_moe):
    async def go():
        engine = EmbeddedEngine(tiny_moe, seed=3)
        sp = SamplingParams(temperature=1.0, max_new_tokens=10, return_routed_experts=True)
        try:
            results = await asyncio.gather(*[engine.generate(p, sp) for p in PROMPTS])
            plain = await engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=3))
            return engine, results, plain
        finally:
            await engine.close()

    engine, results, plain = asyncio.run(go())
    assert engine.routing_shape == SHAPE and plain.routed_experts is None
    same = pairs = 0
    for prompt, r in zip(PROMPTS, results):
        n = len(prompt) + len(r.output_ids) - 1  # every position fed to a forward: the last output token never is
        assert r.routed_experts.shape == (n, 2, 2) and r.routed_experts.dtype == np.uint8
        reference = _full_forward_routing(engine, prompt + r.output_ids)[:n]
        # The same sets as one forward over the whole sequence (prefill and decode differ only by fp32 rounding,
        # which can reorder a near tie: the sets are compared, and >= 95% must agree).
        hits = (np.sort(reference, -1) == np.sort(r.routed_experts, -1)).all(-1)
        same, pairs = same + hits.sum(), pairs + hits.size
        assert hits[: len(prompt)].mean() >= 0.9
    assert same / pairs >= 0.95, same / pairs


def _answer(routing: np.ndarray | None, out: list[int], finish: str = "length") -> dict:
    meta = {"finish_reason": {"type": finish}, "prompt_tokens": 3, "completion_tokens": len(out),
            "output_token_logprobs": [[-0.5, t, None] for t in out]}
    if routing is not None:
        meta["routed_experts"] = base64.b64encode(routing.astype("<i4").tobytes()).decode()
    return {"text": "", "output_ids": out, "meta_info": meta}


def test_sglang_wire_format_is_decoded_and_checked():
    ids = np.arange(6 * 4).reshape(6, 2, 2) % 4  # 3 input + 4 output - 1 positions
    r = parse_response(_answer(ids, [5, 6, 7, 8]), rid="r", routed_experts_of=3)
    assert r.routed_experts.shape == (6, 4) and np.array_equal(r.routed_experts, ids.reshape(6, 4))
    assert parse_response(_answer(ids, [5, 6, 7, 8]), rid="r").routed_experts is None  # not asked: not read
    assert parse_response(_answer(None, [5, 6, 7, 8]), rid="r", routed_experts_of=3).routed_experts is None
    with pytest.raises(EngineError, match=r"holds 20 ids, not a whole number of rows for the 6 positions"):
        parse_response(_answer(ids.reshape(-1)[:20], [5, 6, 7, 8]), rid="r", routed_experts_of=3)
    body = _answer(ids, [5, 6, 7, 8])
    body["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(EngineError, match="not base64 of int32 ids"):
        parse_response(body, rid="r", routed_experts_of=3)


def test_multi_turn_keeps_each_turns_routing_of_what_it_forwarded():
    call = AgentCall(sample_id="p/a/0/0", group_id="p/a/0", agent="a", round=0, prompt_ids=[1, 2, 3], prompt_text="",
                     sampling=SamplingParams(return_routed_experts=True))
    first = np.full((3 + 2 - 1, 4), 1)
    call.add_turn(GenerateResult(output_ids=[7, 8], logprobs=[-1.0, -1.0], text="", finish_reason="stop",
                                 routed_experts=first))
    call.add_environment([20, 21], "env")
    second = np.full((7 + 3 - 1, 4), 2)  # the continuation's request re-forwarded all 7 tokens of the first turn
    call.add_turn(GenerateResult(output_ids=[9, 9, 9], logprobs=[-1.0] * 3, text="", finish_reason="stop",
                                 routed_experts=second))
    # Positions 0-3 as the first turn routed them, 4-8 (the first turn's last token, the environment, the second
    # turn's tokens) from the second.
    assert call.routed_experts[:, 0].tolist() == [1] * 4 + [2] * 5
    call.add_environment([30], "env")
    with pytest.raises(EngineError, match=r"cover positions \[0, 3\); they must end at 11 .* at or before 9"):
        call.add_turn(GenerateResult(output_ids=[9], logprobs=[-1.0], text="", finish_reason="stop",
                                     routed_experts=np.zeros((3, 4))))
    with pytest.raises(EngineError, match="returned no routed experts although return_routed_experts was asked"):
        call.add_turn(GenerateResult(output_ids=[9], logprobs=[-1.0], text="", finish_reason="stop"))


def test_serve_answers_as_sglang_with_the_flag_and_omits_the_key_without(tiny_moe):
    async def go(flag: bool):
        engine = EmbeddedEngine(tiny_moe)
        body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "return_logprob": True, "return_routed_experts": True}
        async with TestServer(Server(engine, routed_experts=flag).app, host="127.0.0.1") as ts, \
                aiohttp.ClientSession() as s:
            try:
                async with s.post(str(ts.make_url("/generate")), json=body) as r:
                    return r.status, await r.json()
            finally:
                await engine.close()

    status, answer = asyncio.run(go(True))
    meta = answer["meta_info"]
    assert status == 200 and meta["completion_tokens"] == 4
    ids = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4")
    assert ids.size == (3 + 4 - 1) * 2 * 2 and ids.min() >= 0 and ids.max() < 4
    status, answer = asyncio.run(go(False))
    assert status == 200 and "routed_experts" not in answer["meta_info"]


def _generate(*args: str) -> subprocess.CompletedProcess:
    return forked.run("rollshard.generate", "--task", "toy", "--limit", "2", "--n-samples", "2", "--max-new-tokens",
                      "6", "--no-progress", *args)


def test_generate_stores_routing_for_a_moe_model_and_refuses_on_for_a_dense_one(tiny_moe, tiny_qwen3, tmp_path):
    res = _generate("--engine", f"embedded:{tiny_moe}", "--out", str(tmp_path / "moe"))
    assert res.returncode == 0, res.stderr
    shard = next((tmp_path / "moe" / "shards").glob("*.parquet"))
    table = pq.read_table(shard)
    assert table.column("routed_experts").null_count == 0
    for row in table.to_pylist():
        n = len(row["prompt_tokens"]) + len(row["response_tokens"]) - 1
        assert len(row["routed_experts"]) == n * 4
    stats = forked.run("rollshard.store", "stats", tmp_path / "moe", "--json")
    import json

    st = json.loads(stats.stdout)
    assert st["rows_with_routing"] == 4 and st["routing"] == [SHAPE.to_config()]
    off = _generate("--engine", f"embedded:{tiny_moe}", "--out", str(tmp_path / "off"), "--routed-experts", "off")
    assert off.returncode == 0 and pq.read_table(next((tmp_path / "off" / "shards").glob("*.parquet"))).column(
        "routed_experts").null_count == 4
    dense = _generate("--engine", f"embedded:{tiny_qwen3}", "--out", str(tmp_path / "dense"), "--routed-experts", "on")
    assert dense.returncode == 2 and not (tmp_path / "dense").exists()
    assert dense.stderr.strip().splitlines()[-1].startswith("rollshard-generate: error: --routed-experts on: the model")
    assert "Traceback" not in dense.stderr


def test_the_shape_comes_from_the_model_folder_or_the_tokenizers(tiny_moe, tiny_qwen3, tmp_path):
    from rollshard.generate.engine_setup import served_model_routing
    from rollshard.store.format.routing import RoutingShapeError

    assert served_model_routing([str(tiny_moe), None]) == SHAPE
    assert served_model_routing(["/a/remote/server/path", str(tiny_moe)]) == SHAPE  # --tokenizer's local folder
    assert served_model_routing([str(tiny_qwen3)]) is None
    with pytest.raises(RoutingShapeError, match="no config.json in the engine's model folder '/remote'.*pass --tokenizer"):
        served_model_routing(["/remote", None])


class _Engine:
    """The part of an engine ``rollshard-generate`` asks about routing."""

    def __init__(self, width, reason=None, error=None):
        self.width, self.routing_reason, self.error = width, reason, error

    async def routed_experts_width(self, sampling):
        if self.error:
            raise EngineError(self.error)
        return self.width


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_the_run_stores_routing_only_of_the_shape_the_engine_returns(tiny_moe, mode, capsys):
    from rollshard.generate.engine_setup import resolve_routing
    from rollshard.generate.engines import EngineSpec
    from rollshard.store.common import UsageError

    def resolve(engine):
        spec = EngineSpec.parse("http://127.0.0.1:9")
        return asyncio.run(resolve_routing(mode, spec, engine, [str(tiny_moe)], SamplingParams()))

    assert resolve(_Engine(4)) == SHAPE
    with pytest.raises(UsageError, match=r"returns 6 expert ids per position, but .* describes 2 layers x top-2 = 4"):
        resolve(_Engine(6))
    with pytest.raises(UsageError, match="one-token return_routed_experts request failed"):
        resolve(_Engine(4, error="a one-token return_routed_experts request failed"))
    for engine, why in ((_Engine(None), "start the SGLang server with --enable-return-routed-experts"),
                        (_Engine(None, reason="Jamba has 2 top-k routers for 4 MoE layers"), "Jamba has 2 top-k")):
        if mode == "on":
            with pytest.raises(UsageError, match=why):
                resolve(engine)
        else:
            assert resolve(engine) is None
            assert why in capsys.readouterr().err

"""Generation and weight updates through the real sglang-router (the Rust router SGLang ships, PyPI 0.3.2)
in front of two ``rollshard-generate serve`` processes, all on 127.0.0.1.

Measured on 0.3.2: it forwards ``/generate`` and ``/get_model_info`` (to one worker) and fans ``/flush_cache``
out, but answers 404 to ``/update_weights_from_disk``, ``/update_weight_version`` and ``/abort_request``; the
client then updates each worker it lists on ``GET /workers`` (rollshard.generate.engines.sglang._post_all)."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import pytest

from rollshard.generate.engines import SamplingParams, make_engine
from rollshard.generate.engines.embedded import load_causal_lm
from rollshard.generate.run import main
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.io.validate import validate_dataset

from .conftest import start_router, stop_server

pytestmark = pytest.mark.cluster
TOL = 1e-5
COMMON = [
    "--agents", "single", "--task", "toy", "--n-samples", "2", "--max-new-tokens", "6", "--limit", "6",
    "--concurrency", "1", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def router(two_servers, tmp_path_factory):
    proc, url = start_router(two_servers, tmp_path_factory.mktemp("router") / "router.log", "--policy", "round_robin")
    yield url
    stop_server(proc)


def rows_of(path):
    return RolloutDataset.open(path).read().drop(["created_at"]).sort_by("sample_id").to_pylist()


def served_version(url: str) -> str:
    with urllib.request.urlopen(url + "/get_model_info", timeout=10) as r:
        return json.load(r)["weight_version"]


def test_generate_through_the_router_gives_the_direct_rows(router, two_servers, tmp_path):
    # concurrency 1: every forward on either worker has batch size 1, so both compute bitwise what one does.
    assert main(["--engine", router, *COMMON, "--out", str(tmp_path / "router")]) == 0
    assert main(["--engine", two_servers[0], *COMMON, "--out", str(tmp_path / "direct")]) == 0
    via_router, direct = rows_of(tmp_path / "router"), rows_of(tmp_path / "direct")
    assert len(via_router) == 12 and via_router == direct
    assert validate_dataset(tmp_path / "router").problems == []
    assert RolloutDataset.open(tmp_path / "router").config["engine"] == router


def test_weight_update_through_the_router_reaches_every_worker(
    router, two_servers, tiny_gpt2, tiny_gpt2_seed1, teacher_forced, caplog
):
    prompt = [1, *range(10, 30)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)

    async def go():
        async with make_engine(router) as eng:
            answers = await eng.update_weights_from_disk(str(tiny_gpt2_seed1), "7")
            versions = [served_version(u) for u in two_servers]
            # Round robin: consecutive requests go to both workers; each must serve the new weights.
            after = await asyncio.gather(*(eng.generate(prompt, greedy, rid=f"after-{i}") for i in range(4)))
            await eng.update_weights_from_disk(str(tiny_gpt2), "0")  # leave the module's servers as they were
            return answers, versions, after

    with caplog.at_level(logging.WARNING, logger="rollshard.generate.engines.sglang"):
        answers, versions, after = asyncio.run(go())
    assert [a["success"] for a in answers] == [True, True]  # one answer per worker, not one for the router
    assert versions == ["7", "7"] and [served_version(u) for u in two_servers] == ["0", "0"]
    assert f"{router} does not forward POST /update_weights_from_disk (HTTP 404: an sglang-router); sent it to its 2 " \
        "workers directly" in caplog.text
    want = teacher_forced(load_causal_lm(tiny_gpt2_seed1), prompt, after[0].output_ids, 0.0)
    for res in after:
        assert res.weight_version == "7" and res.output_ids == after[0].output_ids
        assert max(abs(a - b) for a, b in zip(res.logprobs, want)) <= TOL


def test_a_404_from_a_plain_server_is_not_taken_for_a_router(two_servers):
    async def go():
        async with make_engine(two_servers[0]) as eng:
            return await eng._post_all("/no_such_endpoint", {})

    from rollshard.generate.engines import EngineError

    with pytest.raises(EngineError, match=r"POST /no_such_endpoint failed on http://127\.0\.0\.1:\d+: HTTP 404"):
        asyncio.run(go())

"""rollshard-generate end to end: real engines, real HTTP on 127.0.0.1, real subprocess kills."""

import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from aiohttp import web

from rollshard.generate.agents import make_agent_system
from rollshard.generate.agents.tool_loop import observation
from rollshard.generate.engines.base import Engine, EngineError, EngineUnavailableError, SamplingParams
from rollshard.generate.run import main
from rollshard.generate.runner import Runner, RunnerOptions
from rollshard.generate.tasks import get_task, load_prompts
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.models.tokenizer import apply_chat_template, encode, load_tokenizer
from rollshard.store.io.validate import validate_dataset
from rollshard.store.io.writer import ShardWriter
from tests import forked
from tests.gated_main import Gate, fork_gated, start_gated, wait_for_gate
from tests.generate.test_agents import ScriptedEngine

N_PROMPTS = 4


def base_args(model, out, *extra):
    # concurrency 1: every forward has batch size 1, so separate runs compute bitwise the same numbers
    return [
        "--engine", f"embedded:{model}", "--agents", "multi_agent", "--task", "math", "--n-samples", "2",
        "--max-new-tokens", "6", "--limit", str(N_PROMPTS), "--concurrency", "1", "--no-progress",
        "--out", str(out), *extra,
    ]


def cli(*args):
    return [sys.executable, "-m", "rollshard.generate", *map(str, args)]


def rows_of(path):
    """Every committed row, sorted by sample_id, without the write time."""
    table = RolloutDataset.open(path).read().drop(["created_at"]).sort_by("sample_id")
    return table.to_pylist()


def assert_valid(path):
    report = validate_dataset(path)
    assert report.problems == []


@pytest.fixture(scope="module")
def reference(tiny_gpt2, tmp_path_factory):
    """An uninterrupted multi-agent run on the embedded engine."""
    out = tmp_path_factory.mktemp("ref") / "ds"
    assert main(base_args(tiny_gpt2, out)) == 0
    return out


def test_embedded_multi_agent_run(reference, tiny_gpt2):
    rows = rows_of(reference)
    ds = RolloutDataset.open(reference)
    prompts = load_prompts(get_task("math").default_prompts())[:N_PROMPTS]
    assert {r["prompt_id"] for r in rows} == {p.prompt_id for p in prompts}
    tok = load_tokenizer(tiny_gpt2)
    by_prompt = {p.prompt_id: p for p in prompts}
    for r in rows:
        agent, rnd = r["agent"], r["round"]
        assert (agent, rnd) in {("solver", 0), ("rewriter", 1), ("selector", 2)}
        assert r["group_id"] == f"{r['prompt_id']}/{agent}/{rnd}" and r["sample_id"].startswith(r["group_id"] + "/")
        n = len(r["response_tokens"])
        assert n == len(r["rollout_logprobs"]) == len(r["loss_mask"]) and set(r["loss_mask"]) <= {1}
        assert all(lp < 0 for lp in r["rollout_logprobs"])
        meta = json.loads(r["metadata"])
        assert r["reward"] == pytest.approx(meta["reward_raw"] * meta["episode_weight"], abs=1e-6)
        assert r["weight_version"] == "0" and r["temperature"] == 1.0
        if agent == "solver":  # prompt_tokens are exactly the chat-templated prompt
            msgs = get_task("math").messages(by_prompt[r["prompt_id"]])
            assert r["prompt_tokens"] == apply_chat_template(tok, msgs)
    agents = [r["agent"] for r in rows]
    assert (agents.count("solver"), agents.count("rewriter"), agents.count("selector")) == (8, 8, 4)
    cfg = ds.config  # the run config is in the manifests and in every shard's file metadata
    assert cfg["agents"]["name"] == "multi_agent" and cfg["agents"]["num_solvers"] == 2
    assert cfg["sampling"]["max_new_tokens"] == 6 and cfg["engine"] == f"embedded:{tiny_gpt2}"
    meta = pq.read_schema(ds.files[0]).metadata
    assert json.loads(meta[b"rollshard.config"]) == cfg
    assert_valid(reference)


def test_rerun_is_a_no_op_and_other_settings_are_refused(reference, tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "ds"
    shutil.copytree(reference, out)
    before = rows_of(out)
    assert main(base_args(tiny_gpt2, out)) == 0
    err = capsys.readouterr().err
    assert "0 of 4 prompts done" in err and "4 already there" in err
    assert rows_of(out) == before
    assert main(base_args(tiny_gpt2, out, "--temperature", "0.5")) == 2
    err = capsys.readouterr().err.strip()
    # The setting that differs is named, not the whole sampling block.
    assert "\n" not in err and "holds rows generated with another sampling.temperature (1.0 there, 0.5 now" in err
    assert rows_of(out) == before


def test_resume_after_kill_equals_uninterrupted_run(reference, tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "ds"
    args = base_args(tiny_gpt2, out, "--commit-every", "1")
    # The run stops right after its first shard commit, until killed.
    gate = Gate("rollshard.store.io.writer:ShardWriter.commit", 1, str(tmp_path / "first-commit"))
    proc = fork_gated([gate], "rollshard.generate", *args)
    wait_for_gate(proc, gate)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.communicate()[1]
    partial = rows_of(out)
    done = {r["prompt_id"] for r in partial}
    assert 1 <= len(done) < N_PROMPTS  # killed mid-run, with whole episodes committed
    assert len(partial) == 5 * len(done)  # 2 solvers + 2 rewriters + 1 selector each
    assert main(args) == 0
    assert f"{N_PROMPTS - len(done)} of {N_PROMPTS} prompts done" in capsys.readouterr().err
    assert rows_of(out) == rows_of(reference)  # token ids, logprobs, rewards, texts: all equal
    assert_valid(out)


def test_num_shards_union_equals_one_run(reference, tiny_gpt2, tmp_path):
    # Shard 0 in a subprocess and shard 1 in this process, writing into one dataset at the same time.
    out = tmp_path / "ds"
    proc = forked.start("rollshard.generate", *base_args(tiny_gpt2, out, "--shard-index", 0, "--num-shards", 2))
    assert main(base_args(tiny_gpt2, out, "--shard-index", "1", "--num-shards", "2")) == 0
    assert proc.wait(timeout=300) == 0, proc.communicate()[1]
    ds = RolloutDataset.open(out)
    assert sorted(m.writer_id for m in ds.manifests) == ["gen-0-of-2", "gen-1-of-2"]
    shard0 = {r["prompt_id"] for s in ds.manifests[0].shards for r in pq.read_table(out / s.path).to_pylist()}
    assert shard0 == {"math-000", "math-002"}  # positions 0 and 2 of the source
    assert rows_of(out) == rows_of(reference)
    assert_valid(out)


def test_tool_loop_masks_and_zero_logprobs(tiny_gpt2, tmp_path):
    out = tmp_path / "ds"
    args = [
        "--engine", f"embedded:{tiny_gpt2}", "--agents", "tool_loop", "--task", "math", "--n-samples", "2",
        "--max-new-tokens", "6", "--limit", "3", "--no-progress", "--out", out,
    ]
    assert main(list(map(str, args))) == 0
    tok = load_tokenizer(tiny_gpt2)
    rows = rows_of(out)
    assert len(rows) == 6
    for r in rows:
        mask, lps, ids = np.array(r["loss_mask"]), np.array(r["rollout_logprobs"]), r["response_tokens"]
        env = np.flatnonzero(mask == 0)
        assert env.size and np.all(np.diff(env) == 1)  # one environment block between the two turns
        first = env[0]
        turn1_text = r["response_text"][: r["response_text"].index("\n<result>")]
        assert ids[first : env[-1] + 1] == encode(tok, observation(turn1_text))
        assert np.all(lps[env] == 0.0)
        assert np.all(lps[mask == 1] < 0) and mask[:first].all() and mask[env[-1] + 1 :].all()
        assert json.loads(r["metadata"])["turns"] == 2


def test_bad_inputs_give_one_line_and_write_nothing(tiny_gpt2, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok", "label": "1"}\n{"prompt": "oops"\n{"prompt": "x"}\n')
    out = tmp_path / "ds"

    def fails(*args):
        assert main([*map(str, args), "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("rollshard-generate: error: ")
        assert not out.exists()
        return err

    err = fails("--engine", f"embedded:{tiny_gpt2}", "--prompts", bad)
    assert f"{bad}:2: not valid JSON" in err and "(also malformed: 3)" in err
    port = free_port()  # nothing listens there
    err = fails("--engine", f"http://127.0.0.1:{port}", "--task", "toy")
    assert f"cannot reach engine 'http://127.0.0.1:{port}'" in err
    err = fails("--engine", f"embedded:{tmp_path / 'no-model'}", "--task", "toy")
    assert "cannot start engine" in err
    err = fails("--engine", "ftp://x", "--task", "toy")
    assert "neither 'embedded:PATH' nor" in err
    err = fails("--engine", f"embedded:{tiny_gpt2}", "--agents", "single", "--agent-option", "turns=2")
    assert "single has no option 'turns'" in err
    # A model folder without its tokenizer: refused at start (transformers would build an empty one, and then
    # every request would fail with "empty input_ids").
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_gpt2, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bare / name).unlink()
    err = fails("--engine", f"embedded:{bare}", "--task", "toy")
    assert "cannot start engine" in err and "tokenizer.json" in err


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- a fake SGLang server: canned answers, every response recorded --------------------------------


class FakeSGLang:
    """SGLang's native /generate, /health and /get_model_info on 127.0.0.1, answering canned texts.

    The text of a request is drawn from ``TEXTS`` by its sampling_seed, so answers are
    deterministic; tokens are the tokenizer's ids of the text plus the eos id, logprobs
    drawn from the same generator. Every response body is kept in ``sent`` by rid.
    """

    TEXTS = ["\\boxed{42}", "it is 41", "Judgment: 1", "Judgment: 2", "so \\boxed{42}. Judgment: 7"]

    def __init__(self, model_path, *, die_after=None, preferred=None, support=True):
        self.support = support  # answer return_sampling_mask with a support (token, token + 1), or leave it out
        self.model_path = str(model_path)
        self.tok = load_tokenizer(model_path)
        self.sent = {}
        self.die_after = die_after  # answer this many /generate requests, then stop listening
        self.preferred = preferred  # what /get_model_info reports as preferred_sampling_params
        self.answered = 0

    async def generate(self, request):
        if self.die_after is not None and self.answered >= self.die_after:
            if self.answered == self.die_after:  # the server goes away: its socket closes, connections drop
                self.answered += 1
                asyncio.ensure_future(self.runner.cleanup())
            request.transport.close()
            return web.Response(status=503)
        self.answered += 1
        body = await request.json()
        sp = body["sampling_params"]
        rng = random.Random(sp["sampling_seed"])
        text = rng.choice(self.TEXTS)
        ids = encode(self.tok, text)[: sp["max_new_tokens"]] + [self.tok.eos_token_id]
        lps = [round(-rng.uniform(0.001, 6.0), 6) for _ in ids]
        resp = {
            "text": text,
            "output_ids": ids,
            "meta_info": {
                "id": body["rid"],
                "finish_reason": {"type": "stop", "matched": self.tok.eos_token_id},
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids),
                "weight_version": "w3",
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
            },
        }
        if body.get("return_sampling_mask") and self.support:
            resp["meta_info"]["output_token_sampling_mask"] = [[t, t + 1] for t in ids]
            resp["meta_info"]["output_token_sampling_logprobs"] = [lp / 2 for lp in lps]
        self.sent[body["rid"]] = (body, resp)
        return web.json_response(resp)

    async def info(self, request):
        return web.json_response(
            {"model_path": self.model_path, "tokenizer_path": self.model_path, "weight_version": "w3",
             "preferred_sampling_params": self.preferred}
        )

    async def health(self, request):
        return web.Response(text="ok")

    def __enter__(self):
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            app = web.Application()
            app.add_routes(
                [web.post("/generate", self.generate), web.get("/get_model_info", self.info), web.get("/health", self.health)]
            )
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self.runner.cleanup())

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_multi_agent_over_http_documented_rewards_and_sent_logprobs(tiny_gpt2, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"What is 40 + {i}?", "label": "42"}) + "\n" for i in range(5)))
    out = tmp_path / "ds"
    with FakeSGLang(tiny_gpt2) as server:
        rc = main(["--engine", server.url, "--agents", "multi_agent", "--task", "math", "--prompts", str(prompts),
                   "--n-samples", "3", "--max-new-tokens", "32", "--no-progress", "--out", str(out)])
    assert rc == 0
    rows = rows_of(out)
    assert len(rows) == 5 * 7  # every canned text parses: 3 solvers, 3 rewriters, 1 selector per prompt
    for r in rows:  # stored tokens and logprobs are what the server sent, token for token
        body, resp = server.sent[r["sample_id"] + "/turn0/try0"]
        assert r["prompt_tokens"] == body["input_ids"]
        assert r["response_tokens"] == resp["output_ids"]
        sent_lps = np.array([item[0] for item in resp["meta_info"]["output_token_logprobs"]], dtype=np.float32)
        assert np.array_equal(np.array(r["rollout_logprobs"], dtype=np.float32), sent_lps)
        assert r["weight_version"] == "w3" and r["status"] == "completed"

    def v(text):  # the math verifier on the canned texts: right exactly when 42 is boxed
        return 1.0 if "\\boxed{42}" in text else 0.0

    rights = 0
    for pid in {r["prompt_id"] for r in rows}:
        ep = {r["sample_id"].removeprefix(pid + "/"): r for r in rows if r["prompt_id"] == pid}
        rewrites = [ep[f"rewriter/1/{i}"]["response_text"] for i in range(3)]
        judgments = re.findall(r"Judgment:\s*(\d+)", ep["selector/2/0"]["response_text"])
        j = int(judgments[-1]) if judgments else 0
        picked = v(rewrites[j - 1]) if 1 <= j <= 3 else 0.0
        weight = 1.0 if not 1 <= j <= 3 else 1.2 if picked == 1.0 else 0.8  # no valid verdict: weight 1.0
        rights += picked == 1.0
        expected = {f"solver/0/{i}": v(ep[f"solver/0/{i}"]["response_text"]) * weight for i in range(3)}
        expected.update({f"rewriter/1/{i}": v(rewrites[i]) * weight for i in range(3)})
        expected["selector/2/0"] = picked * weight
        assert {k: r["reward"] for k, r in ep.items()} == pytest.approx(expected, abs=1e-6)
        assert {r["group_id"] for r in ep.values()} == {f"{pid}/solver/0", f"{pid}/rewriter/1", f"{pid}/selector/2"}
    assert 0 < rights < 5  # both branches of the episode weight were exercised


class FlakyEngine(Engine):
    """Wraps an engine; requests of the prompts in ``broken`` fail with an engine error."""

    def __init__(self, inner, broken):
        self.inner, self.broken, self.calls = inner, set(broken), 0

    async def generate(self, input_ids, sampling, *, rid=None):
        self.calls += 1
        if rid.split("/")[0] in self.broken:
            raise EngineError(f"request {rid}: HTTP 503 from http://127.0.0.1:1/generate")
        return await self.inner.generate(input_ids, sampling, rid=rid)

    async def model_info(self):
        return await self.inner.model_info()


def _run(tmp_path, tok, engine, *, retries=2, prompts=None):
    task = get_task("math")
    prompts = prompts or load_prompts(task.default_prompts())[:4]
    with ShardWriter(tmp_path / "ds", writer_id="gen-0-of-1", config={"agents": {"name": "single"}}) as writer:
        runner = Runner(
            system=make_agent_system("single", n_samples=2),
            task=task,
            engine=engine,
            tokenizer=tok,
            sampling=SamplingParams(max_new_tokens=8),
            writer=writer,
            options=RunnerOptions(concurrency=4, retries=retries, backoff_s=0.0, progress=False),
        )
        return asyncio.run(runner.run(prompts))


def test_failure_ledger_then_retry(tiny_gpt2, tmp_path):
    tok = load_tokenizer(tiny_gpt2)
    good = ScriptedEngine(tok, lambda agent, index, turn, ids: "\\boxed{12}")
    result = _run(tmp_path, tok, FlakyEngine(good, {"math-001"}))
    assert result.exit_code == 1 and set(result.failed) == {"math-001"}
    ledger = tmp_path / "ds" / "_failures" / "gen-0-of-1.jsonl"
    (entry,) = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert entry["prompt_id"] == "math-001" and entry["attempts"] == 3  # 1 + 2 retries
    assert entry["error"].startswith("EngineError: request math-001/policy/0/") and "HTTP 503" in entry["error"]
    assert {r["prompt_id"] for r in rows_of(tmp_path / "ds")} == {"math-000", "math-002", "math-003"}

    result = _run(tmp_path, tok, FlakyEngine(good, {"math-001"}), retries=0)  # still broken: attempts add up
    assert json.loads(ledger.read_text())["attempts"] == 4 and result.prompts_skipped == 3

    result = _run(tmp_path, tok, good)  # healthy again: the rerun does exactly the missing prompt
    assert result.exit_code == 0 and result.episodes == 1 and result.rows == 2
    assert not ledger.exists()
    assert len(rows_of(tmp_path / "ds")) == 8


def test_interrupt_commits_complete_episodes(tiny_gpt2, tmp_path):
    tok = load_tokenizer(tiny_gpt2)
    prompts = load_prompts(get_task("math").default_prompts())[:12]
    count = {"n": 0}

    def script(agent, index, turn, ids):
        count["n"] += 1
        if count["n"] == 9:  # Ctrl-C while episodes are in flight
            os.kill(os.getpid(), signal.SIGINT)
        return "\\boxed{1}"

    result = _run(tmp_path, tok, ScriptedEngine(tok, script, delay=0.01), prompts=prompts)
    assert result.exit_code == 130 and result.interrupted
    rows = rows_of(tmp_path / "ds")
    per_prompt = {}
    for r in rows:
        per_prompt[r["prompt_id"]] = per_prompt.get(r["prompt_id"], 0) + 1
    assert 1 <= len(per_prompt) < 12 and set(per_prompt.values()) == {2}  # whole episodes only
    assert not (tmp_path / "ds" / "_failures").exists()  # interrupted prompts are not failures
    result = _run(tmp_path, tok, ScriptedEngine(tok, lambda *a: "\\boxed{1}"), prompts=prompts)
    assert result.exit_code == 0 and result.prompts_skipped == len(per_prompt)
    assert len(rows_of(tmp_path / "ds")) == 24


def test_served_engine_gives_the_embedded_rows(embedded_server, tiny_gpt2, tmp_path):
    # The same run through `rollshard-generate serve` over HTTP and in process: the same rows, token for token.
    common = ["--agents", "single", "--task", "toy", "--n-samples", "2", "--max-new-tokens", "6", "--limit", "3",
              "--concurrency", "1", "--no-progress"]
    assert main(["--engine", embedded_server, *common, "--out", str(tmp_path / "http")]) == 0
    assert main(["--engine", f"embedded:{tiny_gpt2}", *common, "--out", str(tmp_path / "local")]) == 0
    http, local = rows_of(tmp_path / "http"), rows_of(tmp_path / "local")
    assert len(http) == 6 and http == local


# ---- interrupts, a dead engine, prompts that outgrow the context, prompt identity on resume ----------------


def test_second_interrupt_during_the_final_commit_still_commits_complete_episodes(reference, tiny_gpt2, tmp_path):
    out = tmp_path / "ds"
    args = base_args(tiny_gpt2, out, "--commit-every", "1000", "--commit-interval", "100000")
    # Two episodes complete (not yet committed) and two in flight when the first Ctrl-C comes; the second one
    # comes as the final commit is about to start.
    two_done = Gate("rollshard.generate.runner:Runner._finished", 2, str(tmp_path / "two-done"), str(tmp_path / "go1"))
    committing = Gate(
        "rollshard.store.io.writer:ShardWriter.commit", 1, str(tmp_path / "commit"), str(tmp_path / "go2"), before=True
    )
    proc = start_gated(
        [two_done, committing], "rollshard.generate", *args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        wait_for_gate(proc, two_done)
        proc.send_signal(signal.SIGINT)
        (tmp_path / "go1").touch()
        wait_for_gate(proc, committing)
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: proc.poll() is not None or any("still committing" in line for line in lines))
        (tmp_path / "go2").touch()
        assert proc.wait(timeout=300) == 130
    finally:
        proc.kill()
    err = "".join(lines)
    assert "stopping: committing the complete prompts; the 2 in flight are left for a rerun" in err
    assert "still committing the complete prompts; interrupt once more to quit without them" in err
    done = {r["prompt_id"] for r in rows_of(out)}
    assert len(done) == 2 and len(rows_of(out)) == 10  # exactly the two complete episodes, nothing in flight
    assert_valid(out)
    assert main(args) == 0 and rows_of(out) == rows_of(reference)


def wait_until(condition, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


class DyingEngine(Engine):
    """Answers ``healthy`` requests, then raises what a circuit breaker raises for every later one."""

    def __init__(self, inner, healthy):
        self.inner, self.healthy, self.calls = inner, healthy, 0

    async def generate(self, input_ids, sampling, *, rid=None):
        self.calls += 1
        if self.calls > self.healthy:
            raise EngineUnavailableError("SGLang server http://127.0.0.1:1 refused 8 connections in a row")
        return await self.inner.generate(input_ids, sampling, rid=rid)

    async def model_info(self):
        return await self.inner.model_info()


def test_a_dead_engine_stops_the_run_at_once_with_complete_episodes_committed(tiny_gpt2, tmp_path):
    tok = load_tokenizer(tiny_gpt2)
    prompts = load_prompts(get_task("math").default_prompts())[:12]
    good = ScriptedEngine(tok, lambda *a: "\\boxed{1}")
    dying = DyingEngine(good, healthy=6)  # three 2-sample episodes, then the engine is gone
    result = _run(tmp_path, tok, dying, prompts=prompts)
    assert result.exit_code == 1 and result.engine_down and "refused 8 connections" in result.engine_down
    # No episode retried and no prompt put in the ledger: the calls after the engine died are at most those of
    # the episodes already started (8 of 2 calls), not prompts x attempts (9 x 3 x 2).
    assert dying.calls - 6 <= 8 * 2 and not result.failed and result.ledger is None
    assert result.episodes == 3 and len(rows_of(tmp_path / "ds")) == 6
    result = _run(tmp_path, tok, good, prompts=prompts)  # back: the rerun does the rest
    assert result.exit_code == 0 and result.prompts_skipped == 3 and len(rows_of(tmp_path / "ds")) == 24


def test_multi_agent_calls_over_the_context_fail_unless_allowed(tiny_gpt2, tmp_path, capsys):
    # Solver prompts are <= 65 tokens and fit 100 with 6 new tokens; a rewriter prompt is >= 105 tokens.
    common = ["--max-context-len", "100"]
    assert main(base_args(tiny_gpt2, tmp_path / "strict", *common)) == 1
    err = capsys.readouterr().err
    assert "warning: multi_agent: a rewriter prompt with 2 solver answers of up to 6 tokens" in err
    assert "more than the context of 100" in err and "--allow-skipped-calls" in err
    assert "4 prompts failed (first: math-000: ContextFullError: the rewriter prompt is" in err
    assert not (tmp_path / "strict" / "shards").exists() or not rows_of(tmp_path / "strict")

    assert main(base_args(tiny_gpt2, tmp_path / "lenient", *common, "--allow-skipped-calls")) == 0
    err = capsys.readouterr().err
    assert "rows by agent: solver 8; calls skipped (prompt over the context, --allow-skipped-calls): rewriter 8" in err
    assert {r["agent"] for r in rows_of(tmp_path / "lenient")} == {"solver"}


def _prompt_file(path, texts):
    path.write_text("".join(json.dumps({"prompt": t, "label": "1"}) + "\n" for t in texts))
    return path


def test_resume_refuses_prompts_changed_under_their_id(tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "ds"
    source = _prompt_file(tmp_path / "a.jsonl", ["What is 0 + 1?", "What is 1 + 0?", "What is 2 - 1?"])

    def gen(prompts):
        args = ["--engine", f"embedded:{tiny_gpt2}", "--agents", "single", "--task", "math", "--n-samples", "2",
                "--max-new-tokens", "4", "--no-progress", "--prompts", str(prompts), "--out", str(out)]
        return main(args)

    assert gen(source) == 0
    capsys.readouterr()
    before = rows_of(out)
    assert {json.loads(r["metadata"])["prompt_hash"] for r in before}.__len__() == 3
    # Another file with position ids: the same ids name other prompts.
    other = _prompt_file(tmp_path / "b.jsonl", ["What is 5 - 4?", "What is 1 * 1?", "What is 3 - 2?"])
    assert gen(other) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prompt '000000' (position 0 of the source) is not the prompt" in err
    # The same file with its second prompt edited: that one is named.
    edited = _prompt_file(tmp_path / "a.jsonl", ["What is 0 + 1?", "What is 1 + 1?", "What is 2 - 1?"])
    assert gen(edited) == 2
    assert "prompt '000001' (position 1 of the source)" in capsys.readouterr().err
    assert rows_of(out) == before
    # Prompts appended to the source are new work, not a conflict: only they are generated.
    _prompt_file(tmp_path / "a.jsonl", ["What is 0 + 1?", "What is 1 + 0?", "What is 2 - 1?", "What is 9 - 8?"])
    assert gen(source) == 0
    assert "1 of 4 prompts done" in capsys.readouterr().err and len(rows_of(out)) == 8


def test_failure_ledger_temp_file_of_a_crash_is_cleaned(tiny_gpt2, tmp_path):
    tok = load_tokenizer(tiny_gpt2)
    (tmp_path / "ds" / "_failures").mkdir(parents=True)
    leftover = tmp_path / "ds" / "_failures" / f".gen-0-of-1.jsonl.{'0badc0de' * 4}.tmp"
    leftover.write_text('{"prompt_id": ')
    result = _run(tmp_path, tok, ScriptedEngine(tok, lambda *a: "\\boxed{1}"))
    assert result.exit_code == 0 and not leftover.exists()


def test_a_server_that_dies_mid_run_ends_it_with_one_line(tiny_gpt2, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"What is {i} + 1?", "label": "1"}) + "\n" for i in range(40)))
    out = tmp_path / "ds"
    args = ["--agents", "single", "--task", "math", "--prompts", str(prompts), "--n-samples", "2",
            "--max-new-tokens", "8", "--concurrency", "4", "--no-progress", "--out", str(out)]
    with FakeSGLang(tiny_gpt2, die_after=10) as server:
        assert main(["--engine", server.url, *args]) == 1
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "gave up on the engine" in x]
    assert f"SGLang server {server.url} unavailable: 8 connection failures in a row" in line
    assert line.endswith("complete prompts are committed; rerun the same command once it is back")
    rows = rows_of(out)
    assert len(rows) == 2 * len({r["prompt_id"] for r in rows}) <= 10  # whole episodes, from the 10 answers
    assert not (out / "_failures").exists()  # nothing failed: the rest was never tried
    assert_valid(out)
    with FakeSGLang(tiny_gpt2) as server:  # back (on another port): the same command finishes the run
        assert main(["--engine", server.url, *args]) == 0
    assert len(rows_of(out)) == 80
    assert_valid(out)


def test_server_with_preferred_sampling_params_is_refused(tiny_gpt2, tmp_path, capsys):
    args = ["--agents", "single", "--task", "toy", "--limit", "2", "--no-progress", "--out", str(tmp_path / "ds")]
    with FakeSGLang(tiny_gpt2, preferred={"temperature": 0.7, "stop_regex": "x+"}) as server:
        assert main(["--engine", server.url, *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"engine {server.url!r} cannot be used as it is: SGLang server" in err
        assert "stop_regex='x+' (client sends none); restart it without --preferred-sampling-params" in err
        assert not (tmp_path / "ds").exists()
    # A preference for a parameter the client always sends is overridden by the request: accepted.
    with FakeSGLang(tiny_gpt2, preferred={"temperature": 0.7, "min_p": 0.2, "ignore_eos": True}) as server:
        assert main(["--engine", server.url, *args]) == 0


def test_ignore_eos_flag_runs_turns_past_the_eos_and_is_a_resume_setting(eos_everywhere, tiny_gpt2, tmp_path, capsys):
    args = ["--agents", "single", "--task", "toy", "--limit", "2", "--n-samples", "2", "--max-new-tokens", "5",
            "--no-progress"]
    stops, ignores = tmp_path / "stops", tmp_path / "ignores"
    assert main(["--engine", f"embedded:{eos_everywhere}", *args, "--out", str(stops)]) == 0
    assert main(["--engine", f"embedded:{eos_everywhere}", *args, "--ignore-eos", "--out", str(ignores)]) == 0
    # Every id is an eos of this model: without the flag each response is its first token, with it max_new_tokens.
    assert {(len(r["response_tokens"]), r["status"]) for r in rows_of(stops)} == {(1, "completed")}
    assert {(len(r["response_tokens"]), r["status"]) for r in rows_of(ignores)} == {(5, "truncated")}
    assert_valid(ignores)
    assert RolloutDataset.open(ignores).config["sampling"]["ignore_eos"] is True
    assert "ignore_eos" not in RolloutDataset.open(stops).config["sampling"]  # as configs from before the flag
    capsys.readouterr()
    assert main(["--engine", f"embedded:{eos_everywhere}", *args, "--out", str(ignores)]) == 2
    assert "holds rows generated with another sampling.ignore_eos (true there, null now" in capsys.readouterr().err
    assert main(["--engine", f"embedded:{eos_everywhere}", *args, "--ignore-eos", "--out", str(stops)]) == 2
    assert "holds rows generated with another sampling.ignore_eos (null there, true now" in capsys.readouterr().err
    with FakeSGLang(tiny_gpt2) as server:  # the SGLang client sends it
        assert main(["--engine", server.url, *args, "--ignore-eos", "--out", str(tmp_path / "http")]) == 0
        assert {body["sampling_params"]["ignore_eos"] for body, _ in server.sent.values()} == {True}


def test_an_interrupt_during_the_final_commit_still_counts(tiny_gpt2, tmp_path, monkeypatch):
    tok = load_tokenizer(tiny_gpt2)
    commit = ShardWriter.commit
    calls = {"n": 0}

    def commit_with_ctrl_c(self):
        calls["n"] += 1
        if calls["n"] == 1:  # Ctrl-C lands inside the final commit: handled after it, and still an interrupt
            os.kill(os.getpid(), signal.SIGINT)
        return commit(self)

    monkeypatch.setattr(ShardWriter, "commit", commit_with_ctrl_c)
    result = _run(tmp_path, tok, ScriptedEngine(tok, lambda *a: "\\boxed{1}"))
    assert result.exit_code == 130 and result.interrupted and len(rows_of(tmp_path / "ds")) == 8


def test_resume_with_another_allow_skipped_calls_is_refused(tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "ds"
    assert main(base_args(tiny_gpt2, out, "--limit", "1")) == 0
    capsys.readouterr()
    assert main(base_args(tiny_gpt2, out, "--allow-skipped-calls")) == 2
    assert "another allow_skipped_calls (false there, true now" in capsys.readouterr().err


def test_a_tokenizer_without_a_chat_template_is_one_line(tiny_gpt2, tmp_path, capsys):
    bare = tmp_path / "no-template"
    shutil.copytree(tiny_gpt2, bare)
    (bare / "chat_template.jinja").unlink()
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(base_args(bare, tmp_path / "ds")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no chat template" in err


# ---- --sampling-support -----------------------------------------------------------------------------


def _tool_loop_args(model, out, *extra):
    return list(map(str, [
        "--engine", f"embedded:{model}", "--agents", "tool_loop", "--task", "math", "--n-samples", "2",
        "--max-new-tokens", "6", "--limit", "2", "--no-progress", "--out", out, *extra,
    ]))


def test_rows_carry_the_support_with_none_between_turns_and_off_stores_none(tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "ds"
    assert main(_tool_loop_args(tiny_gpt2, out, "--top-k", "5")) == 0  # auto: top-k truncates
    assert_valid(out)
    rows = rows_of(out)
    assert len(rows) == 4
    for r in rows:
        mask = np.array(r["loss_mask"])
        assert (mask == 0).any() and len(r["sampling_support"]) == len(r["response_tokens"])
        for tok, m, support, slp, lp in zip(
            r["response_tokens"], mask, r["sampling_support"], r["sampling_logprobs"], r["rollout_logprobs"]
        ):
            if m:
                assert len(support) == 5 and tok in support and lp - 1e-4 <= slp <= 0.0
            else:  # the calculator's tokens: not sampled, no support
                assert support == [] and slp == 0.0
    config = RolloutDataset.open(out).manifests[0].config
    assert config["sampling_support"] == "on" and config["sampling_support_mode"] == "auto"
    assert "return_sampling_mask" not in config["sampling"]
    capsys.readouterr()
    # The setting is part of what a resume compares.
    assert main(_tool_loop_args(tiny_gpt2, out, "--top-k", "5", "--sampling-support", "off")) == 2
    assert 'another sampling_support ("on" there, "off" now' in capsys.readouterr().err
    off = tmp_path / "off"
    assert main(_tool_loop_args(tiny_gpt2, off, "--top-k", "5", "--sampling-support", "off")) == 0
    assert all(r["sampling_support"] is None and r["sampling_logprobs"] is None for r in rows_of(off))
    assert RolloutDataset.open(off).manifests[0].config["sampling_support"] == "off"


def test_sampling_support_usage_errors(tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "ds"
    sglang = ["--engine", f"http://127.0.0.1:{free_port()}", "--task", "toy", "--no-progress", "--out", str(out)]
    assert main([*sglang, "--top-p", "0.9"]) == 2  # auto with a top-p: SGLang needs a top-k; no server needed
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--sampling-support auto with --top-p 0.9 and no --top-k: SGLang returns" in err
    assert "add --top-k K (K <= the server's --sampling-mask-max-tokens, 4096 by default) or pass --sampling-support off" in err
    assert main([*sglang, "--top-p", "0.9", "--sampling-support", "on"]) == 2
    assert "--sampling-support on with --top-p 0.9 and no --top-k" in capsys.readouterr().err
    embedded = ["--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--no-progress", "--out", str(out)]
    assert main([*embedded, "--sampling-support", "on"]) == 2  # nothing truncates
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--sampling-support on: nothing truncates (--top-p 1, no --top-k)" in err
    assert not out.exists()


def test_a_top_k_of_the_whole_vocabulary_with_supports_is_one_line(tiny_gpt2, tmp_path, capsys):
    embedded = ["--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--no-progress", "--out", str(tmp_path / "ds")]
    assert main([*embedded, "--top-k", "5000"]) == 2  # the tiny tokenizer has 1,024 tokens: nothing truncates
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--top-k 5000 is at least the vocabulary (1024 tokens)" in err
    assert main([*embedded, "--top-k", "5000", "--sampling-support", "off", "--limit", "1", "--n-samples", "1",
                 "--max-new-tokens", "4"]) == 0


def test_rerunning_a_top_p_job_from_before_supports_resumes_it(tiny_gpt2, tmp_path):
    """A dataset generated before supports were stored (no sampling_support in its config): the same command,
    under the new default auto, resumes it without supports instead of refusing a changed setting."""
    import json as _json

    args = ["--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--no-progress", "--out", str(tmp_path / "ds"),
            "--top-p", "0.8", "--n-samples", "2", "--max-new-tokens", "4"]
    assert main([*args, "--sampling-support", "off", "--limit", "2"]) == 0
    manifest = tmp_path / "ds" / "_manifests" / "gen-0-of-1.json"
    doc = _json.loads(manifest.read_text())
    for key in ("sampling_support", "sampling_support_mode"):
        del doc["config"][key]  # as written before schema 1.1
    manifest.write_text(_json.dumps(doc))
    assert main([*args, "--limit", "3"]) == 0
    rows = rows_of(tmp_path / "ds")
    assert len({r["prompt_id"] for r in rows}) == 3 and all(r["sampling_support"] is None for r in rows)


def test_an_sglang_answer_without_the_support_is_retried_then_ledgered(tiny_gpt2, tmp_path):
    args = ["--agents", "single", "--task", "toy", "--limit", "2", "--n-samples", "2", "--top-k", "20",
            "--retries", "1", "--no-progress"]
    with FakeSGLang(tiny_gpt2, support=False) as server:
        assert main(["--engine", server.url, *args, "--out", str(tmp_path / "ds")]) == 1
        assert all(body["return_sampling_mask"] is True for body, _ in server.sent.values())
    ledger = [json.loads(line) for line in (tmp_path / "ds" / "_failures" / "gen-0-of-1.jsonl").read_text().splitlines()]
    assert len(ledger) == 2 and all(e["attempts"] == 2 for e in ledger)
    assert all("response has no meta_info.output_token_sampling_mask" in e["error"] for e in ledger)
    with FakeSGLang(tiny_gpt2) as server:  # a server that sends it: the rows hold exactly what it sent
        assert main(["--engine", server.url, *args, "--out", str(tmp_path / "ok")]) == 0
        sent = {rid.split("/turn")[0]: resp["meta_info"] for rid, (_, resp) in server.sent.items()}
    for r in rows_of(tmp_path / "ok"):
        assert r["sampling_support"] == sent[r["sample_id"]]["output_token_sampling_mask"]
        assert np.allclose(r["sampling_logprobs"], sent[r["sample_id"]]["output_token_sampling_logprobs"], atol=1e-6)


def test_a_config_from_before_the_support_means_off():
    from types import SimpleNamespace

    from rollshard.generate.resume import ConfigMismatchError, check_resume_config

    old = {"agents": {"name": "single"}, "sampling": {"temperature": 1.0}}  # no sampling_support key
    dataset = SimpleNamespace(
        manifests=[SimpleNamespace(config=old, shards=["s"], writer_id="gen-0-of-1")], storage=SimpleNamespace(uri="ds")
    )
    check_resume_config(dataset, {**old, "sampling_support": "off"})
    with pytest.raises(ConfigMismatchError, match='another sampling_support \\("off" there, "on" now'):
        check_resume_config(dataset, {**old, "sampling_support": "on"})


def test_embedded_device_and_dtype_flags(tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "ds"
    args = ["--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--n-samples", "2", "--max-new-tokens", "4",
            "--limit", "2", "--no-progress", "--out", str(out)]
    assert main([*args, "--dtype", "bfloat16"]) == 0
    rows = rows_of(out)
    assert len(rows) == 4 and all(lp <= 0 and np.isfinite(lp) for r in rows for lp in r["rollout_logprobs"])
    assert RolloutDataset.open(out).config["engine_dtype"] == "bfloat16"
    capsys.readouterr()
    assert main(args) == 2  # float32 rows may not join bfloat16 ones
    assert 'another engine_dtype ("bfloat16" there, "float32" now' in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*args[:-1], str(tmp_path / "gpu"), "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "cannot put the model on device 'cuda'" in err
    assert main(["--engine", "http://127.0.0.1:9", *args[2:-1], str(tmp_path / "x"), "--dtype", "bfloat16"]) == 2
    assert "--device and --dtype are for the embedded engine" in capsys.readouterr().err


def test_embedded_threads_flag_reaches_the_engine(tiny_gpt2, tmp_path, capsys, monkeypatch):
    from rollshard.generate.engines import embedded

    import torch

    seen = []  # what the worker sets torch's threads to when it starts (then back to what they were)
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
    args = ["--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--n-samples", "1", "--max-new-tokens", "2",
            "--limit", "1", "--no-progress"]
    before = torch.get_num_threads()
    assert main([*args, "--threads", "1", "--out", str(tmp_path / "a")]) == 0
    assert seen == [1, before]
    seen.clear()
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    assert seen == [embedded.default_threads(), before]
    capsys.readouterr()
    for bad, message in ((["--threads", "0"], "--threads must be >= 1"),
                         (["--engine", "http://127.0.0.1:9", "--threads", "2"], "--threads is for the embedded engine")):
        assert main([*args, *bad, "--out", str(tmp_path / "c")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and not (tmp_path / "c").exists()


def test_failed_prompts_within_max_failed_prompts_exit_0(tiny_gpt2, tmp_path, capsys):
    plugin = tmp_path / "flaky.py"
    plugin.write_text(
        "def reward(sample):\n"
        "    if sample.prompt_id == 'math-001':\n"
        "        raise ValueError('no reward for this one')\n"
        "    return 1.0\n"
    )
    args = [*base_args(tiny_gpt2, tmp_path / "out", "--agents", "single"), "--reward", f"{plugin}:reward", "--retries", "0"]
    assert main(args) == 1  # by default every prompt must succeed
    capsys.readouterr()
    # 1 of 4 failed: 25% is over 0.2 and within 0.25.
    assert main([*args, "--max-failed-prompts", "0.2"]) == 1
    assert "within --max-failed-prompts" not in capsys.readouterr().err
    assert main([*args, "--max-failed-prompts", "0.25"]) == 0
    err = capsys.readouterr().err
    assert "1 of 4 prompts failed (25.00%), within --max-failed-prompts 0.25: exit 0, the dataset holds the others" in err
    assert {r["prompt_id"] for r in rows_of(tmp_path / "out")} == {"math-000", "math-002", "math-003"}
    assert (tmp_path / "out" / "_failures").exists()  # still ledgered: a rerun retries it
    assert main([*args, "--max-failed-prompts", "1.5"]) == 2
    assert "--max-failed-prompts must be a fraction in [0, 1]; got 1.5" in capsys.readouterr().err

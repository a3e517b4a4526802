"""The admission gate (``--max-ahead``): worked numbers, the runner holding episodes back until the engine's
version moves, the prompts already in the dataset counted, an interrupt while it waits, and the flags."""

import asyncio
import contextlib
import json
import os
import signal

import pytest
from aiohttp import web

from rollshard.generate import runner as runner_module
from rollshard.generate.admission import AdmissionGate, integer_version
from rollshard.generate.agents import make_agent_system
from rollshard.generate.engines.base import Engine, SamplingParams
from rollshard.generate.run import main
from rollshard.generate.runner import Runner, RunnerOptions
from rollshard.generate.tasks import get_task, load_prompts
from rollshard.store.io.dataset import DatasetNotFoundError, RolloutDataset
from rollshard.store.io.live import complete_writers
from rollshard.store.models.tokenizer import load_tokenizer
from rollshard.store.io.writer import ShardWriter
from tests.generate.test_agents import ScriptedEngine
from tests.generate.test_run import FakeSGLang

FAST_POLL_S = 0.01  # the gate's re-read interval in these tests: the schedules below count reads, not seconds
MAX_READS = 2000  # a gate that never opens fails the test instead of polling for ever


def test_allowed_worked_numbers():
    gate = AdmissionGate(max_ahead=1, step_episodes=2)
    # (ETA + 1 + v - V0) * B with ETA 1, B 2, V0 0: v 0 -> 2 * 2 = 4; v 1 -> 3 * 2 = 6; v 5 -> 7 * 2 = 14
    assert [gate.allowed(v) for v in (0, 1, 5)] == [4, 6, 14]
    synchronous = AdmissionGate(max_ahead=0, step_episodes=8, first_version=3)
    # ETA 0, B 8, V0 3: v 3 -> 1 * 8 = 8; v 4 -> 2 * 8 = 16; v 2 -> 0 * 8 = 0; v 0 -> -2 * 8, none: 0
    assert [synchronous.allowed(v) for v in (3, 4, 2, 0)] == [8, 16, 0, 0]


def test_integer_version():
    assert [integer_version(v) for v in ("0", "12", " 7 ", 3)] == [0, 12, 7, 3]
    for bad in ("w3", "1.5", None, ""):
        with pytest.raises(ValueError, match="not the integer step --max-ahead counts"):
            integer_version(bad)


class VersionedEngine(Engine):
    """ScriptedEngine's answers; ``model_info`` serves ``versions[call]`` (the last one from then on), records
    how many episodes the runner had started at each call, and calls ``on_call(call)``. With
    ``hold=(CALL, N, DATASET)`` the read CALL answers once DATASET holds N prompts: the episodes started before it are committed, not
    racing the version that stops the run (an interrupt or a version the gate cannot count cancels those still in
    flight, as it should)."""

    def __init__(self, inner, versions, on_call=None, hold=None):
        self.inner, self.versions, self.on_call, self.hold = inner, versions, on_call, hold
        self.runner: Runner | None = None
        self.started_at_call: list[int] = []

    async def generate(self, input_ids, sampling, *, rid=None):
        return await self.inner.generate(input_ids, sampling, rid=rid)

    async def model_info(self):
        call = len(self.started_at_call)
        assert call < MAX_READS, f"the gate never opened: started {self.started_at_call[-5:]}"
        self.started_at_call.append(self.runner.started)
        if self.hold is not None and call == self.hold[0]:
            await _until_committed(self.hold[2], self.hold[1])
        if self.on_call:
            self.on_call(call)
        return {"weight_version": str(self.versions[min(call, len(self.versions) - 1)])}


def _run_gated(tmp_path, tok, engine, prompts, gate):
    with ShardWriter(tmp_path / "ds", writer_id="gen-0-of-1", config={"agents": {"name": "single"}}) as writer:
        runner = Runner(
            system=make_agent_system("single", n_samples=2),
            task=get_task("math"),
            engine=engine,
            tokenizer=tok,
            sampling=SamplingParams(max_new_tokens=8),
            writer=writer,
            options=RunnerOptions(concurrency=4, backoff_s=0.0, commit_every=1, progress=False, admission=gate),
        )
        engine.runner = runner
        return asyncio.run(runner.run(prompts))


def _prompt_ids(path):
    return set(RolloutDataset.open(path).read(columns=["prompt_id"]).column("prompt_id").to_pylist())


async def _until_committed(path, prompts: int) -> None:
    for _ in range(MAX_READS * 10):  # a bound for a broken run, not an expectation of speed
        with contextlib.suppress(DatasetNotFoundError):  # nothing committed yet
            if len(_prompt_ids(path)) >= prompts:
                return
        await asyncio.sleep(FAST_POLL_S)  # the runner commits meanwhile: it runs on this loop
    pytest.fail(f"fewer than {prompts} prompts committed in {path}")


def test_the_gate_starts_episodes_as_the_version_moves(tiny_gpt2, tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "GATE_POLL_S", FAST_POLL_S)
    tok = load_tokenizer(tiny_gpt2)
    prompts = load_prompts(get_task("math").default_prompts())[:8]
    # Reads 0-2 serve version 0, reads 3-4 version 1, then version 2. ETA 1, B 2, V0 0 allow 4, 6, 8 episodes.
    engine = VersionedEngine(ScriptedEngine(tok, lambda *a: "\\boxed{1}"), [0, 0, 0, 1, 1, 2])
    result = _run_gated(tmp_path, tok, engine, prompts, AdmissionGate(max_ahead=1, step_episodes=2))
    assert result.exit_code == 0 and result.episodes == 8
    # Read 0 at the start (none started); 4 start on version 0 and no more while reads 1 and 2 still serve it;
    # read 3 serves version 1: 2 more, then none until read 5 serves version 2 and the last 2 start; the
    # source is then done, and nothing more is read.
    assert engine.started_at_call == [0, 4, 4, 4, 6, 6]


def test_the_gate_counts_the_dataset_and_an_interrupt_ends_its_wait(tiny_gpt2, tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "GATE_POLL_S", FAST_POLL_S)
    tok = load_tokenizer(tiny_gpt2)
    prompts = load_prompts(get_task("math").default_prompts())[:8]
    gate = AdmissionGate(max_ahead=1, step_episodes=2)

    def interrupt_at_third_read(call):  # the gate has been found closed twice: the run waits for a version
        if call == 2:
            os.kill(os.getpid(), signal.SIGINT)

    scripted = ScriptedEngine(tok, lambda *a: "\\boxed{1}")
    engine = VersionedEngine(scripted, [0], interrupt_at_third_read, hold=(2, 4, tmp_path / "ds"))  # version 0 for ever: 4 episodes
    result = _run_gated(tmp_path, tok, engine, prompts, gate)
    assert result.exit_code == 130 and engine.started_at_call == [0, 4, 4]
    assert _prompt_ids(tmp_path / "ds") == {p.prompt_id for p in prompts[:4]}
    # The rerun counts the 4 prompts in the dataset: version 1 allows 6 in all, so 2 more start.
    engine = VersionedEngine(scripted, [1], interrupt_at_third_read, hold=(2, 6, tmp_path / "ds"))
    result = _run_gated(tmp_path, tok, engine, prompts, gate)
    assert result.exit_code == 130 and result.prompts_skipped == 4 and engine.started_at_call == [0, 2, 2]
    assert _prompt_ids(tmp_path / "ds") == {p.prompt_id for p in prompts[:6]}


def test_a_version_that_stops_being_an_integer_ends_the_run_like_a_dead_engine(tiny_gpt2, tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "GATE_POLL_S", FAST_POLL_S)
    tok = load_tokenizer(tiny_gpt2)
    prompts = load_prompts(get_task("math").default_prompts())[:8]
    engine = VersionedEngine(ScriptedEngine(tok, lambda *a: "\\boxed{1}"), [0, "v9"], hold=(1, 4, tmp_path / "ds"))
    result = _run_gated(tmp_path, tok, engine, prompts, AdmissionGate(max_ahead=1, step_episodes=2))
    assert result.exit_code == 1 and "weight_version 'v9', not the integer step" in result.engine_down
    assert engine.started_at_call == [0, 4] and _prompt_ids(tmp_path / "ds") == {p.prompt_id for p in prompts[:4]}


# ---- the flags ------------------------------------------------------------------------------------------


def _prompt_file(tmp_path, n):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"What is 40 + {i}?", "label": "42"}) + "\n"
                            for i in range(n)))
    return path


def _args(engine, out, prompts, *extra):
    return ["--engine", engine, "--agents", "single", "--task", "math", "--prompts", str(prompts), "--n-samples", "1",
            "--max-new-tokens", "8", "--no-progress", "--out", str(out), *extra]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-ahead", "1"], "--max-ahead and --step-episodes go together"),
        (["--step-episodes", "4"], "--max-ahead and --step-episodes go together"),
        (["--max-ahead", "-1", "--step-episodes", "4"], "--max-ahead must be >= 0 and --step-episodes >= 1"),
        (["--max-ahead", "1", "--step-episodes", "0"], "--max-ahead must be >= 0 and --step-episodes >= 1"),
        (["--max-ahead", "1", "--step-episodes", "2", "--num-shards", "2"], "run one writer"),
    ],
)
def test_gate_flags_are_checked_in_one_line(tmp_path, capsys, extra, message):
    args = _args("http://127.0.0.1:1", tmp_path / "ds", _prompt_file(tmp_path, 2), *extra, "--check-args")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_the_embedded_engine_is_refused_with_the_way_to_serve_it(tiny_gpt2, tmp_path, capsys):
    args = _args(f"embedded:{tiny_gpt2}", tmp_path / "ds", _prompt_file(tmp_path, 2), "--max-ahead", "1",
                 "--step-episodes", "2", "--check-args")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "run `rollshard-generate serve --model MODEL` and point --engine at its URL" in err


def test_a_version_that_is_no_integer_is_one_line_and_writes_nothing(tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "ds"
    with FakeSGLang(tiny_gpt2) as server:  # serves weight_version "w3"
        rc = main(_args(server.url, out, _prompt_file(tmp_path, 2), "--max-ahead", "0", "--step-episodes", "1"))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "weight_version 'w3', not the integer step --max-ahead counts" in err
    assert not out.exists() and server.answered == 0


class SteppingSGLang(FakeSGLang):
    """FakeSGLang whose /get_model_info serves version 3 until it has answered 2 generate requests, then 4 (and
    after MAX_READS reads "stuck", which ends the run with exit 1 instead of letting a broken gate poll for ever)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.answered_at_step = None  # generate requests answered when version 4 was first served
        self.reads = 0

    async def info(self, request):
        self.reads += 1
        if self.answered_at_step is None and self.answered >= 2:
            self.answered_at_step = self.answered
        version = "3" if self.answered_at_step is None else "4"
        version = "stuck" if self.reads > MAX_READS else version
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "weight_version": version, "preferred_sampling_params": None})


def test_the_flags_gate_a_run_against_a_server(tiny_gpt2, tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "GATE_POLL_S", FAST_POLL_S)
    out = tmp_path / "ds"
    with SteppingSGLang(tiny_gpt2) as server:
        # ETA 0, B 2, V0 3: version 3 admits (0 + 1 + 0) * 2 = 2 episodes, version 4 admits 4.
        args = _args(server.url, out, _prompt_file(tmp_path, 4), "--max-ahead", "0", "--step-episodes", "2",
                     "--first-version", "3")
        assert main(args) == 0
    # One request per episode (single agent, one sample): exactly 2 were sent before the version moved.
    assert server.answered_at_step == 2 and server.answered == 4
    assert _prompt_ids(out) == {"q0", "q1", "q2", "q3"} and complete_writers(RolloutDataset.open(out).storage) == {
        "gen-0-of-1"
    }

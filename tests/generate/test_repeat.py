"""``--repeat``: the prompts cycled without end, pass k naming prompt ID ``ID~k``; fresh samples each pass, a
rerun resuming pass by pass, the failure ledger and the per-prompt hash check on those ids."""

import asyncio
import dataclasses
import itertools
import json
import os
import signal

import pytest

from rollshard.generate.agents import make_agent_system
from rollshard.generate.engines.base import SamplingParams
from rollshard.generate.run import main
from rollshard.generate.resume import ConfigMismatchError, check_resume_prompts
from rollshard.generate.runner import Runner, RunnerOptions
from rollshard.generate.tasks.schedule import repeat_prompts, source_prompt_id
from rollshard.generate.tasks import get_task, load_prompts
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.io.live import complete_writers
from rollshard.store.models.tokenizer import load_tokenizer
from rollshard.store.io.writer import ShardWriter
from tests.generate.test_agents import ScriptedEngine
from tests.generate.test_run import FlakyEngine, rows_of


def test_repeat_prompts_names_the_passes_and_is_lazy():
    prompts = load_prompts(get_task("math").default_prompts())[:2]
    first = list(itertools.islice(repeat_prompts(prompts), 6))
    assert [p.prompt_id for p in first] == ["math-000", "math-001", "math-000~1", "math-001~1", "math-000~2",
                                             "math-001~2"]
    assert [(p.index, p.content, p.label) for p in first[4:]] == [(p.index, p.content, p.label) for p in prompts]
    assert [source_prompt_id(p.prompt_id) for p in first] == ["math-000", "math-001"] * 3
    assert source_prompt_id("a~b") == "a~b" and source_prompt_id("x~12") == "x"


def interrupt_after_commits(monkeypatch, n):
    """SIGINT this process right after the n-th shard commit (counted from now)."""
    commit, count = ShardWriter.commit, itertools.count(1)

    def gated(self):
        info = commit(self)
        if next(count) == n:
            os.kill(os.getpid(), signal.SIGINT)
        return info

    monkeypatch.setattr(ShardWriter, "commit", gated)


def _cli_args(model, out, *extra):
    # concurrency 1, one commit per episode: the passes finish in order, a commit count is an episode count
    return ["--engine", f"embedded:{model}", "--agents", "single", "--task", "toy", "--n-samples", "2",
            "--max-new-tokens", "4", "--limit", "2", "--concurrency", "1", "--commit-every", "1", "--no-progress",
            "--out", str(out), *extra]


ORDER = [f"toy-00{i}" + (f"~{k}" if k else "") for k in range(8) for i in range(2)]  # the passes' prompt ids


def _ids(rows):
    return {r["prompt_id"] for r in rows}


def test_repeat_samples_each_pass_afresh_and_resumes_pass_by_pass(tiny_gpt2, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ds"
    interrupt_after_commits(monkeypatch, 5)
    assert main(_cli_args(tiny_gpt2, out, "--repeat")) == 130
    first = rows_of(out)
    done = _ids(first)
    assert set(ORDER[:5]) <= done <= set(ORDER[:9])  # 5 committed, then those complete when the interrupt landed
    by_sample = {r["sample_id"]: r for r in first}
    for index in (0, 1):  # pass 1 of each prompt: its prompt, other sample ids, other samples
        base, again = (by_sample[f"toy-001{sfx}/policy/0/{index}"] for sfx in ("", "~1"))
        assert again["prompt_tokens"] == base["prompt_tokens"] and again["group_id"] == "toy-001~1/policy/0"
        assert json.loads(again["metadata"])["prompt_hash"] == json.loads(base["metadata"])["prompt_hash"]
    def samples(prompt_id):
        return [by_sample[f"{prompt_id}/policy/0/{i}"]["response_tokens"] for i in (0, 1)]

    assert samples("toy-001~1") != samples("toy-001") and samples("toy-000~1") != samples("toy-000")
    assert "gen-0-of-1" not in complete_writers(RolloutDataset.open(out).storage)
    capsys.readouterr()

    interrupt_after_commits(monkeypatch, 2)  # the rerun goes on from the first prompt missing
    assert main(_cli_args(tiny_gpt2, out, "--repeat")) == 130
    second = rows_of(out)
    new = _ids(second) - done
    assert len(new) >= 2 and new <= set(ORDER[len(done) : len(done) + 6])
    assert [r for r in second if r["prompt_id"] in done] == first  # what was there is kept, not regenerated
    assert "interrupted; complete prompts are committed" in capsys.readouterr().err

    assert main(_cli_args(tiny_gpt2, out)) == 0  # without --repeat: the same rows, pass 0 is done
    assert "0 of 2 prompts done in" in capsys.readouterr().err
    assert complete_writers(RolloutDataset.open(out).storage) == {"gen-0-of-1"}


def test_repeat_refuses_source_ids_that_look_like_passes(tiny_gpt2, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    lines = [json.dumps({"id": pid, "prompt": "2 + 2?", "label": "4"}) + "\n" for pid in ("a", "a~1")]
    prompts.write_text("".join(lines))
    args = ["--engine", f"embedded:{tiny_gpt2}", "--task", "math", "--prompts", str(prompts), "--no-progress",
            "--out", str(tmp_path / "ds"), "--repeat"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "prompt id 'a~1' (position 1), a pass of 'a'" in err
    assert not (tmp_path / "ds").exists()


def _run(path, tok, engine, prompts, *, mark_complete=True):
    with ShardWriter(path, writer_id="gen-0-of-1", config={"agents": {"name": "single"}}) as writer:
        runner = Runner(
            system=make_agent_system("single", n_samples=2),
            task=get_task("math"),
            engine=engine,
            tokenizer=tok,
            sampling=SamplingParams(max_new_tokens=8),
            writer=writer,
            options=RunnerOptions(concurrency=4, retries=0, backoff_s=0.0, progress=False, mark_complete=mark_complete),
        )
        return asyncio.run(runner.run(prompts))


def interrupt_at_call(n):
    calls = itertools.count(1)

    def script(agent, index, turn, ids):
        if next(calls) == n:
            os.kill(os.getpid(), signal.SIGINT)
        return "\\boxed{1}"

    return script


def test_a_failed_pass_is_ledgered_and_the_rerun_does_it(tiny_gpt2, tmp_path):
    tok = load_tokenizer(tiny_gpt2)
    prompts = load_prompts(get_task("math").default_prompts())[:2]
    out = tmp_path / "ds"
    # Pass 0: calls 1-4; pass 1: math-000~1 calls 5-6, math-001~1 fails without a call; pass 2 from call 7.
    engine = FlakyEngine(ScriptedEngine(tok, interrupt_at_call(10)), {"math-001~1"})
    result = _run(out, tok, engine, repeat_prompts(prompts))
    assert result.exit_code == 130 and set(result.failed) == {"math-001~1"}
    ledger = out / "_failures" / "gen-0-of-1.jsonl"
    assert [json.loads(line)["prompt_id"] for line in ledger.read_text().splitlines()] == ["math-001~1"]
    assert {"math-000", "math-001", "math-000~1"} <= _ids(rows_of(out)) and "math-001~1" not in _ids(rows_of(out))

    # The rerun skips the done prompts: math-001~1 is the first one it starts (calls 1-2), and leaves the ledger.
    engine = ScriptedEngine(tok, interrupt_at_call(6))
    result = _run(out, tok, engine, repeat_prompts(prompts))
    assert result.exit_code == 130 and not result.failed and result.prompts_skipped >= 3
    assert next(iter(engine.requests)).startswith("math-001~1/") and "math-001~1" in _ids(rows_of(out))
    assert not ledger.exists()


def test_the_hash_check_covers_every_pass_of_a_prompt(tiny_gpt2, tmp_path):
    tok = load_tokenizer(tiny_gpt2)
    (prompt,) = load_prompts(get_task("math").default_prompts())[:1]
    out = tmp_path / "ds"
    # A dataset holding pass 1 of math-000 but not pass 0 (pass 0 failed, say).
    assert _run(out, tok, ScriptedEngine(tok, lambda *a: "\\boxed{1}"), [
        dataclasses.replace(prompt, prompt_id="math-000~1")
    ]).exit_code == 0
    ds = RolloutDataset.open(out)
    (stored,) = {json.loads(r["metadata"])["prompt_hash"] for r in rows_of(out)}
    check_resume_prompts(ds, [prompt], lambda p: stored, passes=True)  # the same prompt: resumes
    check_resume_prompts(ds, [prompt], lambda p: "edited")  # without --repeat, math-000~1 is no prompt of the run
    with pytest.raises(ConfigMismatchError, match=r"prompt 'math-000~1' \(position 0 of the source\) is not the "):
        check_resume_prompts(ds, [prompt], lambda p: "edited", passes=True)

"""The writer's end-of-run marker (rollshard.store.io.live): set by a run that did every prompt with none failed,
absent after a failed or interrupted run, withdrawn before a rerun can commit, never set by an endless run."""

import json

from rollshard.generate.tasks import get_task, load_prompts
from rollshard.store.io.live import complete_writers, is_complete
from rollshard.store.io.storage import Storage
from rollshard.store.models.tokenizer import load_tokenizer
from tests.generate.test_agents import ScriptedEngine
from tests.generate.test_repeat import _run, interrupt_at_call
from tests.generate.test_run import FlakyEngine

MARKER = "_complete/gen-0-of-1.json"


def test_a_clean_run_marks_its_writer_and_a_rerun_withdraws_it_before_committing(tiny_gpt2, tmp_path):
    tok = load_tokenizer(tiny_gpt2)
    prompts = load_prompts(get_task("math").default_prompts())[:6]
    out = tmp_path / "ds"
    assert _run(out, tok, ScriptedEngine(tok, lambda *a: "\\boxed{1}"), prompts[:4]).exit_code == 0
    storage = Storage(str(out))
    assert is_complete(storage) and complete_writers(storage) == {"gen-0-of-1"}
    info = json.loads((out / MARKER).read_text())
    # 4 episodes of the single agent with 2 samples: 4 groups of 2 rows
    assert (info["rows"], info["groups"], info["run_episodes"], info["run_rows"]) == (8, 4, 4, 8)

    seen = []

    def script(agent, index, turn, ids):  # the rerun's requests come before any commit of it
        seen.append((out / MARKER).exists())
        return "\\boxed{1}"

    assert _run(out, tok, ScriptedEngine(tok, script), prompts).exit_code == 0
    assert seen and not any(seen)  # withdrawn before its first request
    info = json.loads((out / MARKER).read_text())
    assert (info["rows"], info["groups"], info["run_episodes"], info["run_rows"]) == (12, 6, 2, 4)


def test_no_marker_after_a_failed_or_an_interrupted_run_or_an_endless_one(tiny_gpt2, tmp_path):
    tok = load_tokenizer(tiny_gpt2)
    prompts = load_prompts(get_task("math").default_prompts())[:12]
    out = tmp_path / "ds"
    good = ScriptedEngine(tok, lambda *a: "\\boxed{1}")
    assert _run(out, tok, good, prompts[:2]).exit_code == 0 and (out / MARKER).exists()
    assert _run(out, tok, FlakyEngine(good, {"math-002"}), prompts[:4]).exit_code == 1
    assert not (out / MARKER).exists()
    assert _run(out, tok, good, prompts[:4]).exit_code == 0 and (out / MARKER).exists()  # the failure redone
    assert _run(out, tok, ScriptedEngine(tok, interrupt_at_call(3)), prompts).exit_code == 130
    assert not (out / MARKER).exists()
    assert _run(out, tok, good, prompts, mark_complete=False).exit_code == 0  # what --repeat passes
    assert not (out / MARKER).exists()

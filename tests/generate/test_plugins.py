"""Bring your own task, reward and agent system: by file and by module, through the real command."""

import asyncio
import json
import math
import threading
from pathlib import Path

import pytest
from aiohttp import web

from rollshard.generate.agents import make_agent_system
from rollshard.generate.plugins import PluginError, load
from rollshard.generate.rewards import FunctionScorer, RewardError, to_verdict
from rollshard.generate.run import main
from rollshard.store.io.dataset import RolloutDataset

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "plugins"


def rows_of(path):
    return RolloutDataset.open(path).read().to_pylist()


def config_of(path):
    return RolloutDataset.open(path).config


def ledger_of(path):
    file = Path(path) / "_failures" / "gen-0-of-1.jsonl"
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


def generate(model, out, *extra, task="toy", n=2, limit=4):
    return main([
        "--engine", f"embedded:{model}", "--task", task, "--out", str(out), "--n-samples", str(n),
        "--max-new-tokens", "8", "--limit", str(limit), "--no-progress", *extra,
    ])


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rollshard-generate: error:"), err
    return err[0]


# -- rewards ---------------------------------------------------------------------------------


def test_reward_from_a_file_scores_every_row_and_is_recorded(tiny_gpt2, tmp_path):
    spec = f"{EXAMPLES / 'reward.py'}:digits_briefly"
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", spec) == 0
    rows = rows_of(tmp_path / "ds")
    assert len(rows) == 8
    for r in rows:
        text = r["response_text"]
        chars = [c for c in text if not c.isspace()]
        digits = sum(c.isdigit() for c in chars)
        expected = (digits / len(chars) if chars else 0.0) - 0.01 * max(0, len(r["response_tokens"]) - 8)
        assert r["reward"] == pytest.approx(expected, abs=1e-6)
        verdict = json.loads(r["metadata"])["verdict"]
        assert verdict["digits"] == digits and verdict["reward"] == pytest.approx(expected)
    reward = config_of(tmp_path / "ds")["reward"]
    assert reward["kind"] == "function" and reward["spec"] == spec
    assert reward["file"] == str(EXAMPLES / "reward.py") and len(reward["sha256"]) == 64


def test_async_reward_from_a_module(tiny_gpt2, tmp_path, monkeypatch):
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    write(pkg / "__init__.py", "")
    write(pkg / "judge.py", (
        "import asyncio\n"
        "async def length(sample):\n"
        "    await asyncio.sleep(0)\n"
        "    return len(sample.response_tokens) + 0.5\n"
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", "myrewards.judge:length") == 0
    rows = rows_of(tmp_path / "ds")
    assert [r["reward"] for r in rows] == [len(r["response_tokens"]) + 0.5 for r in rows]
    assert config_of(tmp_path / "ds")["reward"]["file"] == str(pkg / "judge.py")


def test_a_failing_reward_puts_its_prompt_in_the_ledger_with_the_error(tiny_gpt2, tmp_path):
    fn = write(tmp_path / "bad.py", (
        "def score(sample):\n"
        "    if sample.prompt_id == 'toy-001':\n"
        "        raise ZeroDivisionError('no digits to divide by')\n"
        "    if sample.prompt_id == 'toy-002':\n"
        "        return float('nan')\n"
        "    return 1.0\n"
    ))
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", f"{fn}:score") == 1
    rows = rows_of(tmp_path / "ds")
    assert sorted({r["prompt_id"] for r in rows}) == ["toy-000", "toy-003"] and len(rows) == 4  # whole episodes only
    ledger = {e["prompt_id"]: e["error"] for e in ledger_of(tmp_path / "ds")}
    assert set(ledger) == {"toy-001", "toy-002"}
    assert "RewardError" in ledger["toy-001"] and "ZeroDivisionError: no digits to divide by" in ledger["toy-001"]
    assert f"{fn}:score" in ledger["toy-001"] and "reward nan" in ledger["toy-002"]


def test_a_reward_that_never_answers_times_out_into_the_ledger(tiny_gpt2, tmp_path):
    fn = write(tmp_path / "hang.py", (
        "import asyncio\n"
        "async def score(sample):\n"
        "    await asyncio.Event().wait()  # never set: certain to time out\n"
    ))
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", f"{fn}:score", "--reward-timeout", "0.05", "--limit", "2") == 1
    ledger = ledger_of(tmp_path / "ds")
    assert len(ledger) == 2 and all("gave no answer within 0.05 s" in e["error"] for e in ledger)


def test_reward_answers_are_checked():
    assert to_verdict(0.25, "f").correct is False and to_verdict(1, "f").correct is True
    v = to_verdict({"reward": 0.5, "correct": True, "why": "close"}, "f")
    assert (v.reward, v.correct, v.detail) == (0.5, True, {"why": "close"})
    for bad, msg in [("1", "str"), (True, "bool"), (math.inf, "finite"), ({"score": 1}, "without 'reward'")]:
        with pytest.raises(RewardError, match=msg):
            to_verdict(bad, "f")


def _rows(n):
    from rollshard.store.format.schema import Row, Status

    return [Row(sample_id=f"p/a/0/{i}", prompt_id="p", group_id="p/a/0", agent="a", round=0, prompt_tokens=[1],
                response_tokens=[2], rollout_logprobs=[-1.0], loss_mask=[1], reward=None, status=Status.COMPLETED,
                metadata={"label": 1}) for i in range(n)]


def test_reward_answers_that_do_not_fit_a_row_are_refused():
    import numpy as np

    assert to_verdict(np.float32(0.5), "f").reward == 0.5 and to_verdict(np.int64(2), "f").reward == 2.0
    for bad, msg in [(10**400, "finite float32"), (1e39, "finite float32"), ({"reward": 1, "n": object()}, "plain JSON"),
                     ({"reward": 1, "x": math.nan}, "plain JSON")]:
        with pytest.raises(RewardError, match=msg):
            to_verdict(bad, "f")


def test_async_rewards_run_concurrently_up_to_the_bound():
    inside, peak = [0], [0]

    async def score(sample):
        inside[0] += 1
        peak[0] = max(peak[0], inside[0])
        await asyncio.sleep(0)  # let every other call that can start, start
        await asyncio.sleep(0)
        inside[0] -= 1
        return 1.0

    scorer = FunctionScorer(score, identity={"spec": "t"}, concurrency=3, timeout=60)
    verdicts = asyncio.run(scorer.verdicts([(r, "x") for r in _rows(8)]))
    assert [v.reward for v in verdicts] == [1.0] * 8 and peak[0] == 3


def test_hung_sync_calls_hold_their_slot_until_they_return():
    release = threading.Event()

    def score(sample):
        if sample.sample_id.endswith(("/0", "/1")):
            assert release.wait(60)  # hangs until the test lets it go
        return 2.0

    async def scenario():
        scorer = FunctionScorer(score, identity={"spec": "t"}, concurrency=2, timeout=0.05)
        rows = _rows(4)
        hung = await asyncio.gather(*(scorer.verdict(r, "x") for r in rows[:2]), return_exceptions=True)
        assert all(isinstance(e, RewardError) and "gave no answer" in str(e) for e in hung)
        with pytest.raises(RewardError, match="gave no answer"):  # both threads still hold their slot
            await scorer.verdict(rows[2], "x")
        release.set()
        for _ in range(2):  # the gate: both slots come back once the hung threads return
            await asyncio.wait_for(scorer._threads.acquire(), 60)
        for _ in range(2):
            scorer._threads.release()
        scorer.timeout = 60.0  # the next call is not meant to time out, however slow the machine
        assert (await scorer.verdict(rows[3], "x")).reward == 2.0

    asyncio.run(scenario())


def test_a_hung_sync_reward_does_not_keep_the_process_alive(tiny_gpt2, tmp_path):
    import subprocess
    import sys

    fn = write(tmp_path / "hang.py", "import threading\ndef score(sample):\n    threading.Event().wait()\n")
    proc = subprocess.run(
        [sys.executable, "-m", "rollshard.generate", "--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--out",
         str(tmp_path / "ds"), "--n-samples", "2", "--max-new-tokens", "4", "--limit", "1", "--no-progress",
         "--reward", f"{fn}:score", "--reward-timeout", "0.2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1 and "gave no answer within 0.2 s" in proc.stderr


def test_sync_rewards_run_concurrently_up_to_the_bound():
    """Sync functions run on threads, at most `concurrency` at once: a gate lets them go only once 3 are in."""
    inside, peak, lock, gate = [0], [0], threading.Lock(), threading.Event()

    def score(sample):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            if inside[0] == 3:
                gate.set()
        assert gate.wait(30)
        with lock:
            inside[0] -= 1
        return 1.0

    rows = _rows(6)
    scorer = FunctionScorer(score, identity={"spec": "t"}, concurrency=3, timeout=60)
    verdicts = asyncio.run(scorer.verdicts([(r, "x") for r in rows]))
    assert [v.reward for v in verdicts] == [1.0] * 6 and peak[0] == 3


class RewardServer:
    """A reward server on 127.0.0.1: reward = digits in the response; the first request answers 503."""

    def __init__(self):
        self.requests: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    async def _score(self, request):
        body = await request.json()
        self.requests.append(body)
        if len(self.requests) == 1:
            return web.Response(status=503, text="warming up")
        return web.json_response({"reward": sum(c.isdigit() for c in body["response"]), "served": True})

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/score", self._score)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/score"
        self.ready.set()
        self.loop.run_forever()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_remote_reward_server(tiny_gpt2, tmp_path):
    server = RewardServer()
    try:
        assert generate(tiny_gpt2, tmp_path / "ds", "--reward-url", server.url) == 0
    finally:
        server.close()
    rows = rows_of(tmp_path / "ds")
    assert len(rows) == 8 and len(server.requests) == 9  # one 503, retried
    for r in rows:
        assert r["reward"] == sum(c.isdigit() for c in r["response_text"])
        assert json.loads(r["metadata"])["verdict"]["served"] is True
    sent = {q["sample_id"]: q for q in server.requests}
    r = rows[0]
    assert sent[r["sample_id"]]["response_tokens"] == r["response_tokens"]
    assert sent[r["sample_id"]]["prompt_text"] == r["prompt_text"] and sent[r["sample_id"]]["label"] == "0123456789"
    assert config_of(tmp_path / "ds")["reward"] == {"kind": "http", "url": server.url}


# -- tasks -----------------------------------------------------------------------------------


def test_task_from_a_file_brings_its_prompts_template_and_verifier(tiny_gpt2, tmp_path):
    assert generate(tiny_gpt2, tmp_path / "ds", task=f"{EXAMPLES / 'task.py'}:LETTERS", limit=6) == 0
    rows = rows_of(tmp_path / "ds")
    assert sorted({r["prompt_id"] for r in rows}) == [f"w{i}" for i in range(6)]
    import re

    for r in rows:
        meta = json.loads(r["metadata"])
        assert meta["task"] == "letters" and "How many letters are in the word" in r["prompt_text"]
        numbers = re.findall(r"-?\d+", r["response_text"])
        expected = 0.0 if not numbers else 1.0 / (1 + abs(int(numbers[-1]) - meta["label"]))
        assert r["reward"] == pytest.approx(expected)
    cfg = config_of(tmp_path / "ds")
    assert cfg["task"] == "letters" and cfg["task_plugin"]["file"] == str(EXAMPLES / "task.py")
    assert cfg["prompts"] == str(EXAMPLES / "words.jsonl")


# -- agent systems ---------------------------------------------------------------------------


def test_agent_system_from_a_file_with_options(tiny_gpt2, tmp_path):
    spec = f"{EXAMPLES / 'agents.py'}:DraftRevise"
    assert generate(tiny_gpt2, tmp_path / "ds", "--agents", spec, "--agent-option", "revise_prompt=Shorter.", n=3) == 0
    rows = rows_of(tmp_path / "ds")
    by_agent = {a: [r for r in rows if r["agent"] == a] for a in ("drafter", "reviser")}
    assert len(by_agent["drafter"]) == len(by_agent["reviser"]) == 12
    assert {r["group_id"].split("/", 1)[1] for r in rows} == {"drafter/0", "reviser/1"}
    assert all("Shorter." in r["prompt_text"] for r in by_agent["reviser"])
    agents = config_of(tmp_path / "ds")["agents"]
    assert agents["name"] == "draft_revise" and agents["n_samples"] == 3 and agents["plugin"]["spec"] == spec


CHEATS = '''
import dataclasses
from rollshard.generate.agents import AgentSystem

class Cheat(AgentSystem):
    name = "cheat"
    how = "{how}"
    max_parallel_calls = 1

    async def run(self, episode):
        call = await episode.call("policy", 0, 0, episode.task.messages(episode.prompt))
        row = episode.row(call)
        if self.how == "drop":  # keep the tokens, lose the logprobs
            row.rollout_logprobs = []
        elif self.how == "zeros":  # aligned, finite, but not the engine's
            row.rollout_logprobs = [0.0] * len(row.response_tokens)
        elif self.how == "forge":  # a row no call made
            row = dataclasses.replace(row, sample_id=row.sample_id[:-1] + "9")
        elif self.how == "twice":
            return [row, row]
        elif self.how == "inplace":  # the same list objects, edited
            row.rollout_logprobs[:] = [0.0] * len(row.rollout_logprobs)
        elif self.how == "regroup":  # one GRPO group across prompts
            row.group_id = "shared"
        elif self.how == "retext":  # a response text the engine did not write, for the verifier to read
            row.response_text = "9999999999"
        elif self.how == "version":
            row.weight_version, row.weight_versions = "v999", None
        elif self.how == "label":
            row.metadata["label"] = "something else"
        elif self.how == "nonjson":
            row.metadata["when"] = object()
        return [row]
'''


@pytest.mark.parametrize(
    "how, error",
    [
        ("drop", "changed rollout_logprobs"),
        ("zeros", "changed rollout_logprobs"),
        ("forge", "is not one of its episode's engine calls"),
        ("twice", "twice"),
        ("inplace", "changed rollout_logprobs"),
        ("regroup", "changed group_id"),
        ("retext", "changed response_text"),
        ("version", "changed weight_version"),
        ("label", "changed metadata.label"),
        ("nonjson", "is not plain JSON"),
    ],
)
def test_a_plugin_system_cannot_write_rows_without_the_engines_logprobs(tiny_gpt2, tmp_path, how, error):
    plugin = write(tmp_path / "cheat.py", CHEATS.replace("{how}", how))
    assert generate(tiny_gpt2, tmp_path / "ds", "--agents", f"{plugin}:Cheat", limit=2) == 1
    assert not (tmp_path / "ds" / "shards").exists() or rows_of(tmp_path / "ds") == []
    ledger = ledger_of(tmp_path / "ds")
    assert len(ledger) == 2 and all("RowProvenanceError" in e["error"] and error in e["error"] for e in ledger)


def test_an_honest_plugin_system_writes(tiny_gpt2, tmp_path):
    plugin = write(tmp_path / "cheat.py", CHEATS.replace("{how}", "none"))
    assert generate(tiny_gpt2, tmp_path / "ds", "--agents", f"{plugin}:Cheat", limit=2) == 0
    assert len(rows_of(tmp_path / "ds")) == 2


# -- identity and resume ---------------------------------------------------------------------


def test_resume_refuses_an_edited_plugin(tiny_gpt2, tmp_path, capsys):
    fn = write(tmp_path / "r.py", "def score(sample):\n    return 1.0\n")
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", f"{fn}:score", limit=2) == 0
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", f"{fn}:score", limit=3) == 0  # same code: resumes
    assert len({r["prompt_id"] for r in rows_of(tmp_path / "ds")}) == 3
    capsys.readouterr()
    write(fn, "def score(sample):\n    return 0.5\n")
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", f"{fn}:score", limit=4) == 2
    assert "another reward.sha256" in one_line_error(capsys)
    assert generate(tiny_gpt2, tmp_path / "ds", limit=4) == 2  # the task's verifier instead of the function
    assert "another reward" in one_line_error(capsys)


def test_resume_compares_a_plugins_spec_and_hash_not_where_its_file_lies(tiny_gpt2, tmp_path, monkeypatch):
    for host in ("a", "b"):  # two checkouts of the same code
        (tmp_path / host).mkdir()
        write(tmp_path / host / "r.py", "def score(sample):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path / "a")
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", "r.py:score", limit=2) == 0
    monkeypatch.chdir(tmp_path / "b")
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", "r.py:score", limit=3) == 0
    assert len({r["prompt_id"] for r in rows_of(tmp_path / "ds")}) == 3


def test_a_dataset_from_before_rewards_were_recorded_was_scored_by_its_task(tiny_gpt2, tmp_path, capsys):
    assert generate(tiny_gpt2, tmp_path / "ds", limit=2) == 0
    manifest = tmp_path / "ds" / "_manifests" / "gen-0-of-1.json"
    doc = json.loads(manifest.read_text())
    del doc["config"]["reward"], doc["config"]["task_plugin"]  # as an older rollshard wrote it
    manifest.write_text(json.dumps(doc))
    fn = write(tmp_path / "r.py", "def score(sample):\n    return 1.0\n")
    capsys.readouterr()
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", f"{fn}:score", limit=3) == 2
    assert "another reward" in one_line_error(capsys)
    assert generate(tiny_gpt2, tmp_path / "ds", limit=3) == 0


def test_option_types_of_a_plugin_system(tmp_path):
    plugin = write(tmp_path / "sys.py", (
        "from __future__ import annotations\n"
        "import dataclasses\n"
        "from rollshard.generate.agents import AgentSystem\n"
        "class S(AgentSystem):\n"
        "    max_parallel_calls = 1\n"
        "    @dataclasses.dataclass(kw_only=True)\n"
        "    class Options:\n"
        "        n_samples: int = 2\n"
        "        scale: float | None = None\n"
        "        tags: list = dataclasses.field(default_factory=list)\n"
        "    def __init__(self, options):\n"
        "        self.options = options\n"
        "    async def run(self, episode):\n"
        "        return []\n"
    ))
    system = make_agent_system(f"{plugin}:S", n_samples=5, options={"scale": "2"})
    assert (system.options.n_samples, system.options.scale, system.name) == (5, 2.0, "S")
    assert make_agent_system(f"{plugin}:S", options={"scale": "none"}).options.scale is None
    with pytest.raises(ValueError, match="expected float"):
        make_agent_system(f"{plugin}:S", options={"scale": "big"})
    with pytest.raises(ValueError, match="sets int, float, bool and str"):
        make_agent_system(f"{plugin}:S", options={"tags": "a"})


@pytest.mark.parametrize(
    "option, source, message",
    [
        ("--reward", None, "no such file"),
        ("--reward", "x = 1\n", "has no attribute 'score' (it defines: x)"),
        ("--reward", "import nope_not_a_module\n", "ModuleNotFoundError: No module named 'nope_not_a_module' (p.py line 1)"),
        ("--reward", "def score(:\n", "SyntaxError"),
        ("--reward", "score = 3\n", "is a int, not a function"),
        ("--task", "score = 3\n", "not a Task"),
        ("--agents", "score = 3\n", "not an AgentSystem subclass"),
    ],
)
def test_bad_plugins_are_one_line(tiny_gpt2, tmp_path, capsys, option, source, message):
    path = tmp_path / "p.py"
    if source is not None:
        write(path, source)
    assert generate(tiny_gpt2, tmp_path / "ds", option, f"{path}:score") == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "ds").exists()


def test_bad_reward_settings_are_one_line(tiny_gpt2, tmp_path, capsys):
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward-concurrency", "0") == 2
    assert "--reward-concurrency must be >= 1" in one_line_error(capsys)
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward", "a.py:f", "--reward-url", "http://127.0.0.1:1/") == 2
    assert "not both" in one_line_error(capsys)
    assert generate(tiny_gpt2, tmp_path / "ds", "--reward-url", "127.0.0.1:1") == 2
    assert "expected an http:// or https:// URL" in one_line_error(capsys)


def test_a_missing_module_says_how_to_name_a_file(tmp_path):
    with pytest.raises(PluginError, match="no module 'nope_pkg' on the path.*for a file write path/to/file.py:fn"):
        load("nope_pkg.sub:fn", what="--reward")


def test_two_plugin_files_of_one_name_do_not_collide(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    write(tmp_path / "a" / "reward.py", "VALUE = 'a'\n")
    write(tmp_path / "b" / "reward.py", "VALUE = 'b'\n")
    assert load(f"{tmp_path / 'a' / 'reward.py'}:VALUE", what="x").obj == "a"
    assert load(f"{tmp_path / 'b' / 'reward.py'}:VALUE", what="x").obj == "b"


def test_unknown_builtin_names_mention_plugins():
    with pytest.raises(ValueError, match="or give your own as module:Class"):
        make_agent_system("nope")


# -- chat formatting -------------------------------------------------------------------------


def test_system_prompt_chat_template_and_raw_prompts(tiny_gpt2, tmp_path):
    assert generate(tiny_gpt2, tmp_path / "sys", "--system-prompt", "You count digits.", limit=1) == 0
    row = rows_of(tmp_path / "sys")[0]
    assert "You count digits." in row["prompt_text"]
    assert config_of(tmp_path / "sys")["system_prompt"] == "You count digits."

    template = write(tmp_path / "t.jinja", "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}A:")
    assert generate(tiny_gpt2, tmp_path / "tpl", "--chat-template", str(template), limit=1) == 0
    row = rows_of(tmp_path / "tpl")[0]
    assert row["prompt_text"].startswith("<<user>>") and row["prompt_text"].endswith("A:")
    chat = config_of(tmp_path / "tpl")["chat_template"]
    assert chat["mode"] == "file" and chat["template"] == template.read_text() and chat["path"] == str(template)

    assert generate(tiny_gpt2, tmp_path / "raw", "--no-chat-template", "--system-prompt", "S.", limit=1) == 0
    row = rows_of(tmp_path / "raw")[0]
    from rollshard.generate.tasks import get_task, load_prompts

    first = load_prompts(get_task("toy").default_prompts(), label_required=False)[0]
    assert row["prompt_text"] == f"S.\n\n{first.content}"
    assert config_of(tmp_path / "raw")["chat_template"] == {"mode": "raw", "path": None, "sha256": None, "template": None}


def test_the_default_chat_template_is_recorded(tiny_gpt2, tmp_path):
    assert generate(tiny_gpt2, tmp_path / "ds", limit=1) == 0
    chat = config_of(tmp_path / "ds")["chat_template"]
    assert chat["mode"] == "tokenizer" and chat["template"] and len(chat["sha256"]) == 64

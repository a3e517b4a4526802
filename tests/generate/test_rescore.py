"""``rollshard-generate rescore``: new rewards from stored rows, the agent system's rule, nothing else changed."""

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rollshard.generate.agents import make_agent_system
from rollshard.generate.cli import main as cli
from rollshard.generate.run import main as generate
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.format.lineage import lineage_of
from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.store.format.schema import rows_to_table
from rollshard.store.io.writer import ShardWriter
from rollshard.train.advantages import grpo_advantages

from .test_agents import ma_script, run_episode, tok  # noqa: F401 (tok is a fixture)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "plugins"
LETTERS = '''
def score(sample):
    """Reward: the fraction of letters (the opposite of the toy task's digits)."""
    chars = [c for c in sample.response if not c.isspace()]
    fraction = sum(c.isalpha() for c in chars) / len(chars) if chars else 0.0
    return {"reward": fraction, "correct": fraction >= 0.5}
'''


@pytest.fixture(scope="module")
def multi_agent(tiny_gpt2, tmp_path_factory) -> Path:
    """A multi-agent toy dataset from the embedded engine: 6 prompts, 2 solvers and 2 rewriters each, in two shards
    (a run of 3 prompts, then a resume to 6)."""
    out = tmp_path_factory.mktemp("rescore") / "ma"
    args = ["--engine", f"embedded:{tiny_gpt2}", "--agents", "multi_agent", "--task", "toy", "--n-samples", "2",
            "--max-new-tokens", "12", "--out", str(out), "--no-progress"]
    assert generate([*args, "--limit", "3"]) == 0 and generate([*args, "--limit", "6"]) == 0
    return out


def table(path) -> pa.Table:
    return RolloutDataset.open(path).read().sort_by("sample_id")


def rescore(*args) -> int:
    return cli(["rescore", *map(str, args), "--no-progress"])


def advantages(t: pa.Table) -> torch.Tensor:
    groups = t.column("group_id").to_pylist()
    index = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    return grpo_advantages(
        torch.tensor(t.column("reward").to_pylist()), torch.tensor([index[g] for g in groups])
    ).advantages


def test_rescore_with_the_dataset_own_rule_reproduces_it_and_copies_every_shard(multi_agent, tmp_path, capsys):
    assert len(RolloutDataset.open(multi_agent).shards) == 2
    assert rescore(multi_agent, "--out", tmp_path / "same") == 0
    assert "0 changed); shards: 2 copied, 0 rewritten" in capsys.readouterr().err
    assert table(tmp_path / "same").equals(table(multi_agent))


def test_rescore_with_another_reward_changes_rewards_and_advantages_and_nothing_else(multi_agent, tmp_path):
    fn = tmp_path / "letters.py"
    fn.write_text(LETTERS)
    assert rescore(multi_agent, "--out", tmp_path / "new", "--reward", f"{fn}:score") == 0
    old, new = table(multi_agent), table(tmp_path / "new")
    for name in old.column_names:
        if name not in ("reward", "metadata"):
            assert new.column(name).equals(old.column(name)), name  # tokens, logprobs, ids, texts: identical
    assert new.column("reward") != old.column("reward")
    assert not torch.allclose(advantages(new), advantages(old))

    # The multi-agent rule, recomputed from the stored rows with the new verifier.
    rows = {r["sample_id"]: r for r in new.to_pylist()}
    by_prompt: dict[str, list[dict]] = {}
    for r in rows.values():
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    weights = set()
    for episode in by_prompt.values():
        raw = {}
        for r in episode:
            meta = json.loads(r["metadata"])
            if r["agent"] != "selector":
                chars = [c for c in (meta["answer"] or "") if not c.isspace()]
                raw[r["sample_id"]] = sum(c.isalpha() for c in chars) / len(chars) if chars else 0.0
        selector = [r for r in episode if r["agent"] == "selector"]
        picked = json.loads(selector[0]["metadata"])["selected"] if selector else None
        right = picked is not None and raw[picked] >= 0.5
        weight = 1.0 if picked is None else 1.2 if right else 0.8  # no valid verdict (or no selector): 1.0
        weights.add(weight)
        for r in episode:
            meta = json.loads(r["metadata"])
            v = raw.get(r["sample_id"], raw.get(picked, 0.0))
            assert meta["reward_raw"] == pytest.approx(v) and meta["episode_weight"] == weight
            assert meta["selector_right"] is right and r["reward"] == pytest.approx(v * weight, abs=1e-6)
    assert len(by_prompt) == 6  # the random model's selectors rarely pick right: the scripted test below does

    entry = lineage_of(tmp_path / "new")[0]
    assert entry["operation"] == "rescore" and entry["parent_fingerprint"] == RolloutDataset.open(multi_agent).fingerprint
    assert entry["details"]["reward"]["spec"] == f"{fn}:score" and len(entry["details"]["reward"]["sha256"]) == 64
    assert entry["details"]["agents"]["name"] == "multi_agent"


def test_rescoring_is_idempotent_and_trains_like_any_dataset(multi_agent, tmp_path, capsys):
    fn = tmp_path / "letters.py"
    fn.write_text(LETTERS)
    assert rescore(multi_agent, "--out", tmp_path / "a", "--reward", f"{fn}:score") == 0
    assert rescore(multi_agent, "--out", tmp_path / "b", "--reward", f"{fn}:score") == 0
    a, b = table(tmp_path / "a"), table(tmp_path / "b")
    assert a.column("reward").equals(b.column("reward")) and a.column("metadata").equals(b.column("metadata"))
    capsys.readouterr()
    assert rescore(tmp_path / "a", "--out", tmp_path / "aa", "--reward", f"{fn}:score") == 0  # again: unchanged
    assert "0 changed); shards: 2 copied" in capsys.readouterr().err
    assert len(lineage_of(tmp_path / "aa")) == 2  # rescore of a rescore

    with RolloutLoader(tmp_path / "a", LoaderConfig(groups_per_step=4, shuffle=False)) as loader:
        steps = list(loader)
    trained = {sid: float(x) for s in steps for mb in s.micro_batches for sid, x in zip(mb.sample_ids, mb.rewards)}
    stored = dict(zip(a.column("sample_id").to_pylist(), a.column("reward").to_pylist()))
    groups = {g for g, st in zip(a.column("group_id").to_pylist(), a.column("status").to_pylist())
              if st in ("completed", "truncated")}
    assert len(steps) == len(groups) // 4 and len(trained) > 0
    assert all(trained[sid] == stored[sid] for sid in trained)  # the loader trains on the new rewards


def test_rescore_with_a_task_verifier_of_another_task(multi_agent, tmp_path):
    assert rescore(multi_agent, "--out", tmp_path / "exact", "--task", "exact") == 0
    new = table(tmp_path / "exact")
    labels = {json.loads(m)["label"] for m in new.column("metadata").to_pylist()}
    assert labels == {"0123456789"}
    for r in new.to_pylist():  # exact match of the answer against the label: nothing the random model wrote
        assert r["reward"] == 0.0


def test_a_failing_reward_stops_the_rescore_and_a_rerun_continues(multi_agent, tmp_path, capsys):
    ds = RolloutDataset.open(multi_agent)
    last = sorted(ds.shards, key=lambda s: s.path)[-1]  # derive goes shard by shard in path order
    import pyarrow.parquet as pq

    failing = sorted(set(pq.read_table(ds.storage.path(last.path), columns=["prompt_id"]).column(0).to_pylist()))[0]
    flag = tmp_path / "broken"
    flag.touch()
    fn = tmp_path / "flaky.py"
    fn.write_text(
        "from pathlib import Path\n"
        f"FLAG = Path({str(flag)!r})\n"
        "def score(sample):\n"
        f"    if FLAG.exists() and sample.prompt_id == {failing!r}:\n"
        "        raise ValueError('the judge is down')\n"
        "    return 0.25\n"
    )
    assert rescore(multi_agent, "--out", tmp_path / "out", "--reward", f"{fn}:score") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ValueError: the judge is down" in err[0] and f"on {failing}/" in err[0]
    assert "rerun to continue" in err[0]
    assert len(RolloutDataset.open(tmp_path / "out").shards) == 1  # the first shard is committed
    flag.unlink()  # the judge is back; the function's file is unchanged, so the rerun is the same rescore
    assert rescore(multi_agent, "--out", tmp_path / "out", "--reward", f"{fn}:score") == 0
    out = table(tmp_path / "out")
    assert out.num_rows == table(multi_agent).num_rows and out.column("sample_id").equals(table(multi_agent).column("sample_id"))
    solvers_rewriters = [json.loads(r["metadata"]) for r in out.to_pylist() if r["agent"] != "selector"]
    assert {m["reward_raw"] for m in solvers_rewriters} == {0.25}


def test_rescore_usage_errors_are_one_line(multi_agent, tmp_path, capsys):
    cases = [
        (["--reward", "nope.py:fn"], "no such file"),
        (["--reward", "a.py:fn", "--reward-url", "http://127.0.0.1:1"], "not both"),
        (["--task", "nope"], "unknown task 'nope'"),
        (["--agents", "nope"], "unknown agent system 'nope'"),
        (["--reward-timeout", "0"], "--reward-timeout > 0"),
    ]
    for extra, message in cases:
        assert rescore(multi_agent, "--out", tmp_path / "x", *extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert rescore(tmp_path / "missing", "--out", tmp_path / "x") == 2
    assert "no rollshard dataset here" in capsys.readouterr().err
    assert rescore(multi_agent, "--out", multi_agent / "inside") == 2
    assert not (tmp_path / "x").exists()


def test_generation_into_a_rescored_dataset_is_refused(multi_agent, tiny_gpt2, tmp_path, capsys):
    assert rescore(multi_agent, "--out", tmp_path / "new", "--task", "exact") == 0
    capsys.readouterr()
    args = ["--engine", f"embedded:{tiny_gpt2}", "--agents", "multi_agent", "--task", "toy", "--n-samples", "2",
            "--max-new-tokens", "12", "--out", str(tmp_path / "new"), "--no-progress", "--limit", "8"]
    assert generate(args) == 2
    assert "is a derived dataset (rescore of" in capsys.readouterr().err


def test_rescore_recomputes_the_selector_and_the_episode_weight(tok, tmp_path):  # noqa: F811
    """A scripted episode (test_agents.py): under math the selector picks the right rewrite (x 1.2). A reward for
    which 13 is right makes solver 1 right and the picked rewrite wrong: the episode weight drops to 0.8."""
    rows, _ = run_episode(make_agent_system("multi_agent", n_samples=3), tok, ma_script("Judgment: 2"))
    config = {"agents": make_agent_system("multi_agent", n_samples=3).config(), "task": "math"}
    with ShardWriter(tmp_path / "ds", writer_id="gen-0-of-1", config=config) as w:
        w.write_groups(rows_to_table(rows))
    fn = tmp_path / "thirteen.py"
    fn.write_text("def score(sample):\n    return 1.0 if sample.response.strip().endswith('13') else 0.0\n")
    assert rescore(tmp_path / "ds", "--out", tmp_path / "new", "--reward", f"{fn}:score") == 0
    new = {r["sample_id"].removeprefix("p0/"): r["reward"] for r in table(tmp_path / "new").to_pylist()}
    assert new == {
        "solver/0/0": 0.0, "solver/0/1": pytest.approx(0.8), "solver/0/2": 0.0,
        "rewriter/1/0": 0.0, "rewriter/1/1": 0.0, "rewriter/1/2": 0.0,
        "selector/2/0": 0.0,
    }
    assert all(json.loads(m)["episode_weight"] == 0.8 for m in table(tmp_path / "new").column("metadata").to_pylist())
    # The math verifier again, on the rescored rows: the generated rewards, exactly.
    assert rescore(tmp_path / "new", "--out", tmp_path / "back", "--task", "math") == 0
    back, ds = table(tmp_path / "back"), table(tmp_path / "ds")
    assert back.column("reward").equals(ds.column("reward")) and back.column("metadata").equals(ds.column("metadata"))


def test_a_reward_sees_the_same_metadata_when_rescoring(tiny_gpt2, tmp_path, capsys):
    """Scoring writes metadata (the verdict); a function must not see it, or rescoring would change its answers."""
    fn = tmp_path / "meta.py"
    fn.write_text("def score(sample):\n    return {'reward': float(len(sample.metadata)), 'keys': sorted(sample.metadata)}\n")
    args = ["--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--n-samples", "2", "--max-new-tokens", "4",
            "--limit", "2", "--out", str(tmp_path / "ds"), "--no-progress", "--reward", f"{fn}:score"]
    assert generate(args) == 0
    keys = json.loads(table(tmp_path / "ds").column("metadata")[0].as_py())["verdict"]["keys"]
    assert keys == ["label", "last_turn_start", "prompt_hash", "system", "task", "turns"]
    capsys.readouterr()
    assert rescore(tmp_path / "ds", "--out", tmp_path / "again") == 0
    assert "0 changed); shards: 1 copied" in capsys.readouterr().err


def test_a_rescore_of_a_rescore_defaults_to_the_last_scorer(multi_agent, tmp_path, capsys):
    fn = tmp_path / "letters.py"
    fn.write_text(LETTERS)
    assert rescore(multi_agent, "--out", tmp_path / "a", "--reward", f"{fn}:score") == 0
    capsys.readouterr()
    assert rescore(tmp_path / "a", "--out", tmp_path / "b") == 0  # the letters function, not the toy verifier
    assert "0 changed); shards: 2 copied" in capsys.readouterr().err


@pytest.mark.parametrize(
    "selector_text, status, weight",
    [("**Judgment:** 2", "ok", 1.2), ("I pick the second one.", "missing", 1.0)],
)
def test_rescore_of_an_older_dataset_reads_the_verdict_again(tok, tmp_path, selector_text, status, weight):  # noqa: F811
    """Rows as older versions stored them: the verdict read by ``Judgment:\\s*(\\d+)`` (so ``**Judgment:** 2`` was
    malformed), no judgment_status or answer_status, and every reward x 0.8 without a valid verdict. Rescoring with
    the dataset's own rule reads the verdict from the stored answer: the markdown one picks the right rewrite
    (x 1.2); with none, the correct solver 0 and rewriter 1 get 1.0 instead of 0.8."""
    rows, _ = run_episode(make_agent_system("multi_agent", n_samples=3), tok, ma_script(selector_text))
    for row in rows:
        meta = row.metadata
        meta.pop("answer_status")
        if row.agent == "selector":
            meta.pop("judgment_status")
            meta.update(judgment=None, selected=None, reward_raw=0.0)
        meta.update(episode_weight=0.8, selector_right=False)
        row.reward = meta["reward_raw"] * 0.8
    config = {"agents": make_agent_system("multi_agent", n_samples=3).config(), "task": "math"}
    with ShardWriter(tmp_path / "ds", writer_id="gen-0-of-1", config=config) as w:
        w.write_groups(rows_to_table(rows))
    assert rescore(tmp_path / "ds", "--out", tmp_path / "new") == 0
    new = {r["sample_id"].removeprefix("p0/"): r for r in table(tmp_path / "new").to_pylist()}
    assert {k: r["reward"] for k, r in new.items()} == pytest.approx({
        "solver/0/0": weight, "solver/0/1": 0.0, "solver/0/2": 0.0,
        "rewriter/1/0": 0.0, "rewriter/1/1": weight, "rewriter/1/2": 0.0,
        "selector/2/0": weight if status == "ok" else 0.0,
    }, abs=1e-6)
    sel = json.loads(new["selector/2/0"]["metadata"])
    assert (sel["judgment_status"], sel["judgment"], sel["selected"], sel["episode_weight"]) == (
        (status, 2, "p0/rewriter/1/1", 1.2) if status == "ok" else (status, None, None, 1.0))
    assert "answer_status" not in json.loads(new["solver/0/0"]["metadata"])  # recorded by generation only

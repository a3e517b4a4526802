"""rollshard-generate eval: held-out figures with worked numbers, and the command end to end on the tiny model."""

from __future__ import annotations

import json

import pytest

from rollshard.generate.cli import main as generate_cli
from rollshard.generate.eval import figures, pass_at_k


def _rows(prompt_id: str, correct: list[bool]) -> list[dict]:
    verdict = lambda c: json.dumps({"verdict": {"reward": float(c), "correct": c}})  # noqa: E731
    return [{"prompt_id": prompt_id, "reward": float(c), "metadata": verdict(c), "status": "completed"} for c in correct]


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2) / C(4,2)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(8, 2, 3) == pytest.approx(1 - 20 / 56)  # 1 - C(6,3) / C(8,3)
    with pytest.raises(ValueError, match="pass@5 needs at least 5 answers"):
        pass_at_k(4, 1, 5)


def test_figures_of_several_samples():
    rows = _rows("a", [True, False, False, False]) + _rows("b", [False] * 4) + _rows("c", [True] * 4)
    rows[5]["status"] = "truncated"
    f = figures(rows, n_samples=4)
    assert f["prompts"] == 3 and f["answers"] == 12
    assert f["mean@4"] == pytest.approx(5 / 12)
    assert f["pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert f["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert f["pass@4"] == pytest.approx(2 / 3)
    assert f["truncated"] == pytest.approx(1 / 12) and f["mean_reward"] == pytest.approx(5 / 12)


def test_correct_is_the_verdict_else_a_full_reward():
    rows = [
        {"prompt_id": "a", "reward": 0.9, "metadata": json.dumps({"verdict": {"correct": True}}), "status": "completed"},
        {"prompt_id": "b", "reward": 1.0, "metadata": json.dumps({"verdict": {"correct": False}}), "status": "completed"},
        {"prompt_id": "c", "reward": 1.0, "metadata": "{}", "status": "completed"},  # no verdict: reward >= 1
        {"prompt_id": "d", "reward": 0.5, "metadata": "{}", "status": "completed"},
    ]
    assert figures(rows, n_samples=1)["pass@1"] == 0.5


def test_a_prompt_with_fewer_answers_bounds_pass_at_j():
    f = figures(_rows("a", [True, False, True, False]) + _rows("b", [True, False]), n_samples=4)
    assert "pass@2" in f and "pass@4" not in f
    assert f["pass@2"] == pytest.approx(((1 - 1 / 6) + 1.0) / 2)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--n-samples", "4", "--temperature", "0"], "--n-samples 4 at --temperature 0 draws one answer 4 times"),
        (["--agents", "multi_agent"], "--agents: set by eval itself"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
    ],
)
def test_bad_options_are_one_line(tiny_gpt2, tmp_path, capsys, extra, message):
    assert generate_cli(["eval", "--model", str(tiny_gpt2), "--task", "arithmetic", "--out", str(tmp_path / "e"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "e").exists()


def test_a_missing_model_is_one_line(tmp_path, capsys):
    assert generate_cli(["eval", "--model", str(tmp_path / "nope"), "--task", "arithmetic"]) == 2
    assert "--model" in capsys.readouterr().err


def test_eval_writes_a_dataset_and_its_figures(tiny_gpt2, tmp_path, capsys):
    from rollshard.store.commands import main as store_main

    out = tmp_path / "eval"
    argv = ["eval", "--model", str(tiny_gpt2), "--task", "arithmetic", "--limit", "3", "--n-samples", "4",
            "--max-new-tokens", "6", "--out", str(out), "--json", "--no-progress"]  # fmt: skip
    assert generate_cli(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out / "eval.json").read_text())
    assert printed == written
    assert written["prompts"] == 3 and written["answers"] == 12 and written["split"] == "eval"
    assert written["temperature"] == 1.0 and written["n_samples"] == 4
    assert written["pass@1"] == pytest.approx(written["mean@4"])  # the unbiased pass@1 is the mean with equal n
    assert set(written) >= {"pass@2", "pass@4"}
    assert store_main(["validate", str(out)]) == 0  # eval.json beside the shards keeps a valid dataset
    from rollshard.store.io.dataset import RolloutDataset

    config = RolloutDataset.open(out).config
    assert config["agents"] == {"n_samples": 4, "name": "single"} and config["split"] == "eval"
    assert config["sampling"]["temperature"] == 1.0

    # The same command again resumes the finished run: no row added, the same figures, eval.json accepted.
    capsys.readouterr()
    assert generate_cli(argv) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out) == written
    assert RolloutDataset.open(out).num_rows == written["answers"]

"""rollshard-train says when a run cannot learn: every group at advantage 0 (before the first step), and the
step-0 mismatch (always, on a fresh run), with a warning when it is far above fp32 rounding on rows another model
generated."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.models.fingerprint import model_fingerprint
from rollshard.train.checks import MISMATCH_FAR_NATS, no_signal_warning
from rollshard.train.cli import main
from rollshard.train.metrics import read_metrics
from rollshard.train.trainer import Trainer
from tests.train.conftest import generation_config, write_rows
from tests.train.test_cli import args_for

MISMATCH_LINE = re.compile(
    r"^rollshard-train: step-0 mismatch \|logp - rollout_logp\| over (\d+) tokens: mean (\S+), max (\S+) nats "
    r"\(the policy before any update against the stored rollout logprobs\)$"
)
FP32_TOL = 1e-4  # the tiny model's own samples, recomputed in fp32 (measured ~1e-6)


def lines(err: str, prefix: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(prefix)]


def mismatch_of(err: str) -> tuple[int, float, float]:
    found = [MISMATCH_LINE.match(line) for line in err.splitlines()]
    found = [m for m in found if m]
    assert len(found) == 1, err
    tokens, mean, high = found[0].groups()
    return int(tokens), float(mean), float(high)


# -- no learning signal ---------------------------------------------------------------------------------


def warning_of(tmp_path, groups, *, drop=False, single_member="reward", agents=None, name="ds"):
    ds = RolloutDataset.open(write_rows(tmp_path / name, groups))
    return no_signal_warning(
        [ds], statuses=("completed", "truncated"), agents=agents, drop_zero_variance=drop, single_member=single_member
    )


@pytest.mark.parametrize(
    "groups, single_member, expected",
    [
        # 4 groups of 4 rows, every reward 0: all zero variance, one reward across the dataset.
        ([[0.0] * 4] * 4, "reward", "of the 4 groups in --data, 4 have zero reward variance (every reward is 0), so"),
        # Equal within each group, not across them: still no signal, and no common reward to name.
        ([[1.0, 1.0], [0.0, 0.0], [0.5, 0.5, 0.5]], "reward",
         "of the 3 groups in --data, 3 have zero reward variance, so"),
        # A one-row group of reward 0 trains at advantage 0 under --single-member reward (its advantage is its reward).
        ([[0.0], [1.0, 1.0]], "reward", "of the 2 groups in --data, 1 have zero reward variance and 1 are one row "
                                        "with reward 0, so"),
        # Under --single-member zero any one-row group is at advantage 0.
        ([[0.7], [1.0, 1.0]], "zero", "of the 2 groups in --data, 1 have zero reward variance and 1 are one row "
                                      "(--single-member zero), so"),
    ],
)
def test_every_group_at_advantage_zero_is_named(tmp_path, groups, single_member, expected):
    warning = warning_of(tmp_path, groups, single_member=single_member)
    assert warning is not None and warning.startswith("no learning signal: " + expected), warning
    assert "every advantage is 0 and every step's loss and gradient will be 0" in warning
    # A weak model whose samples are all wrong finds a right one at a lower temperature, not a higher one (the
    # README's SmolLM2 round: none right of 64 at 1.0, one group with a right answer at 0.7).
    assert warning.endswith("or at another temperature (lower where a model's samples all fail, higher where they all "
                            "succeed) so a group's rewards can differ"), warning


@pytest.mark.parametrize(
    "groups, single_member",
    [
        ([[0.0, 1.0], [1.0, 1.0], [1.0, 1.0]], "reward"),  # one group of spread 0.71 is enough
        ([[0.7], [1.0, 1.0]], "reward"),  # a one-row group of reward 0.7 trains at advantage 0.7
    ],
)
def test_a_run_with_any_signal_is_not_warned(tmp_path, groups, single_member):
    assert warning_of(tmp_path, groups, single_member=single_member) is None


def test_drop_zero_variance_counts_what_the_loader_keeps(tmp_path):
    # Every group zero variance: the loader drops them all and refuses the run itself (no warning to add).
    assert warning_of(tmp_path, [[0.0, 0.0], [1.0, 1.0]], drop=True, name="a") is None
    # What is left after the drop is a one-row group of reward 0: at advantage 0 too.
    warning = warning_of(tmp_path, [[0.0, 0.0], [0.0]], drop=True, name="b")
    assert warning.startswith("no learning signal: of the 1 groups in --data, 1 are one row with reward 0"), warning


def test_the_cli_warns_in_one_line_before_the_first_step(tiny_gpt2, tmp_path, capsys, monkeypatch):
    data = write_rows(tmp_path / "zero", [[0.0] * 4] * 4, config=generation_config(tiny_gpt2))
    seen_before_step = []
    step = Trainer.train_step

    def first_step(self, batch):
        seen_before_step.append(capsys.readouterr().err)
        return step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", first_step)
    assert main(args_for(data, tiny_gpt2, tmp_path / "run", "--max-steps", "1")) == 0
    warned = lines(seen_before_step[0], "rollshard-train: warning: no learning signal")
    assert len(warned) == 1, seen_before_step[0]
    assert "of the 4 groups in --data, 4 have zero reward variance (every reward is 0)" in warned[0]
    assert read_metrics(tmp_path / "run")[0]["loss/total"] == 0.0  # what it warned of


def test_drop_zero_variance_refuses_such_a_run_as_before(tiny_gpt2, tmp_path, capsys):
    data = write_rows(tmp_path / "zero", [[0.0] * 4] * 4, config=generation_config(tiny_gpt2))
    out = tmp_path / "run"
    assert main(args_for(data, tiny_gpt2, out, "--drop-zero-variance")) == 2
    err = capsys.readouterr().err
    assert lines(err, "rollshard-train: error: no step to train: 0 of 4 groups pass the filters"), err
    assert "warning" not in err and not (out / "checkpoints").exists()


# -- the step-0 mismatch --------------------------------------------------------------------------------


def test_a_fresh_run_prints_its_step_0_mismatch_and_no_warning_on_its_own_rows(tiny_dataset, tiny_gpt2, tmp_path,
                                                                              capsys):
    out = tmp_path / "run"
    assert main(args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", "2")) == 0
    err = capsys.readouterr().err
    tokens, mean, high = mismatch_of(err)
    first = read_metrics(out)[0]
    # One mini-batch: every forward of step 1 precedes its update, so the line is step 1's own figures.
    assert tokens == first["data/loss_tokens"] and tokens > 0
    assert mean == pytest.approx(first["mismatch/abs_diff_mean"], rel=1e-2)  # printed to 3 digits
    assert high == pytest.approx(first["mismatch/abs_diff_max"], rel=1e-2)
    assert 0 <= mean <= high < FP32_TOL
    assert "warning" not in err
    # A resumed run is not at step 0: its weights are not the rows' any more, and it says nothing of them.
    assert main(args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", "3", "--resume")) == 0
    assert not MISMATCH_LINE.search(capsys.readouterr().err)


@pytest.mark.parametrize("mode", ["bypass", "decoupled"])  # decoupled: from the proximal forward it runs anyway
def test_with_mini_batches_the_mismatch_is_of_the_weights_before_any_update(mode, tiny_dataset, tiny_gpt2, tmp_path,
                                                                             capsys):
    common = ["--max-steps", "1", "--lr", "0.05", "--micro-batch-tokens", "32", "--mode", mode]
    assert main(args_for(tiny_dataset, tiny_gpt2, tmp_path / "one", *common)) == 0
    one = mismatch_of(capsys.readouterr().err)
    assert main(args_for(tiny_dataset, tiny_gpt2, tmp_path / "two", *common, "--mini-batches", "2")) == 0
    two = mismatch_of(capsys.readouterr().err)
    # The same step and weights: the same tokens and figures as the one-update run, though the second
    # mini-batch's forward of the logged metrics ran after an update at lr 0.05.
    assert two[0] == one[0] and two[1] == pytest.approx(one[1], rel=1e-2) and two[2] == pytest.approx(one[2], rel=1e-2)
    logged = read_metrics(tmp_path / "two")[0]["mismatch/abs_diff_mean"]
    assert logged > 10 * max(two[1], 1e-9), (logged, two)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A tiny GPT-2 of another seed: the same architecture and tokenizer, other weights."""
    from rollshard.generate.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "other-gpt2", preset="tiny-gpt2", seed=1)


def test_another_model_than_the_rows_is_warned_in_one_line(tiny_dataset, tiny_gpt2, other_model, tmp_path, capsys):
    assert main(args_for(tiny_dataset, other_model, tmp_path / "run", "--max-steps", "1")) == 0
    err = capsys.readouterr().err
    _, _, high = mismatch_of(err)
    assert high > MISMATCH_FAR_NATS
    warned = lines(err, "rollshard-train: warning: step-0 mismatch max")
    assert len(warned) == 1, err
    # tiny_dataset records its model's path only (as datasets made before fingerprints): compared by path.
    assert f"far above fp32 rounding (> 0.01) and the rows were generated by another model ({tiny_gpt2}, by its " \
           f"recorded path) than --model {other_model.resolve()}" in warned[0], warned[0]


def test_the_recorded_fingerprint_decides_over_the_path(tiny_gpt2, other_model, tmp_path, capsys):
    # Rows of fixed logprobs (-1.0): far from any model's, so only the model comparison decides the warning.
    moved = tmp_path / "moved-gpt2"
    shutil.copytree(tiny_gpt2, moved)
    same = {**generation_config(tmp_path / "gone" / "tiny-gpt2"), "model_fingerprint": model_fingerprint(tiny_gpt2)}
    data = write_rows(tmp_path / "same", [[0.0, 1.0]] * 2, config=same)
    assert main(args_for(data, moved, tmp_path / "r1", "--max-steps", "1")) == 0
    err = capsys.readouterr().err
    assert mismatch_of(err)[2] > MISMATCH_FAR_NATS and "warning" not in err  # another path, the same weights

    # The recorded path is --model's, but the weights there are not the ones that generated the rows.
    overwritten = {**generation_config(moved.resolve()), "model_fingerprint": model_fingerprint(other_model)}
    data = write_rows(tmp_path / "overwritten", [[0.0, 1.0]] * 2, config=overwritten)
    assert main(args_for(data, moved, tmp_path / "r2", "--max-steps", "1")) == 0
    warned = lines(capsys.readouterr().err, "rollshard-train: warning: step-0 mismatch max")
    assert len(warned) == 1 and f"fingerprint {model_fingerprint(other_model)}; --model's is " \
                                  f"{model_fingerprint(tiny_gpt2)}" in warned[0], warned


def test_the_generation_config_records_the_fingerprint(tiny_gpt2, tmp_path):
    from rollshard.generate.run import main as generate

    out = tmp_path / "ds"
    assert generate(["--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--out", str(out), "--n-samples", "2",
                     "--max-new-tokens", "2", "--limit", "1", "--no-progress"]) == 0  # fmt: skip
    config = RolloutDataset.open(out).config
    assert config["model_fingerprint"] == model_fingerprint(tiny_gpt2) and json.dumps(config)

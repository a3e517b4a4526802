"""``rollshard-loop`` checks its ``--train`` and ``--generate`` flags with the stages' own parsers before round 0
starts: a bad one is one line, and no stage runs."""

from __future__ import annotations

import pytest

from rollshard.train.loop import EXIT_FAILED, Loop, LoopSettings
from rollshard.train.loop import main as loop_main
from tests.train.test_loop import loop_args


@pytest.fixture
def stages(monkeypatch) -> list[str]:
    """What each stage the loop starts would do; the first one fails at once (exit 1) instead of running."""
    started: list[str] = []

    def stage(self, k, rounds, what, command, stdout=None):
        started.append(what)
        return EXIT_FAILED

    monkeypatch.setattr(Loop, "run_stage", stage)
    return started


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--train", "--lrr 1"], "rollshard-loop: error: --train: unrecognized arguments: --lrr 1"),
        (["--train", "--eps-low 1.5"], "rollshard-loop: error: --train: --eps-low 1.5 must be in [0, 1] (1: no lower bound)"),
        (["--train", "--agg nope"], "rollshard-loop: error: --train: --agg: 'nope' is not one of"),
        (["--generate", "--bogus 3"], "rollshard-loop: error: --generate: unrecognized arguments: --bogus 3"),
        (["--generate", "--temperature -0.5"],
         "rollshard-loop: error: --generate: --temperature -0.5 must be a finite number >= 0"),
        (["--generate", "--n-samples x"],
         "rollshard-loop: error: --generate: argument --n-samples: invalid int value: 'x'"),
    ],
)
def test_a_bad_stage_flag_is_one_line_before_anything_runs(tiny_gpt2, tmp_path, capsys, stages, extra, message):
    out = tmp_path / "run"
    assert loop_main(loop_args(tiny_gpt2, out, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert stages == [] and not out.exists()


def test_the_dry_run_checks_the_flags_too(tiny_gpt2, tmp_path, capsys, stages):
    assert loop_main(loop_args(tiny_gpt2, tmp_path / "run", "--dry-run", "--generate", "--top-k 0")) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--top-k 0 must be -1 (no top-k) or >= 1" in captured.err


def test_good_stage_flags_pass_the_check_and_round_0_generates(tiny_gpt2, tmp_path, capsys, stages):
    # Flags of each stage's own, the ones the loop's owned-flag screen lets through among them (--mode, --config).
    config = tmp_path / "train.yaml"
    config.write_text("loss:\n  eps_high: 0.3\n")
    extra = ["--train", f"--mode decoupled --config {config}", "--generate", "--temperature 0 --top-k -1"]
    assert loop_main(loop_args(tiny_gpt2, tmp_path / "run", *extra)) == EXIT_FAILED
    assert stages == ["generating"]  # the check passed; the first stage is round 0's generation


@pytest.mark.parametrize(
    "train, config, sets",
    [
        ([], None, False),
        (["--final-checkpoint", "full"], None, True),
        (["--final", "full"], None, True),  # abbreviated, as rollshard-train reads it
        (["--final-checkpoint=model"], None, True),
        (["--config", "{cfg}"], "trainer:\n  final_checkpoint: full\n", True),
        (["--config", "{cfg}"], "trainer:\n  keep_last: 3\n", False),
        (["--lr", "1e-5", "--config={cfg}"], "optim:\n  lr: 1.0e-4\n", False),
    ],
)
def test_the_loop_writes_model_only_round_checkpoints_unless_train_says_otherwise(tmp_path, train, config, sets):
    from rollshard.train.loop_stages import sets_final_checkpoint

    cfg = tmp_path / "train.yaml"
    if config is not None:
        cfg.write_text(config)
    train = [t.replace("{cfg}", str(cfg)) for t in train]
    assert sets_final_checkpoint(train) is sets
    settings = LoopSettings(model="model", engine="embedded", window=1, seed=0, generate=[], train=train)
    args = Loop(tmp_path / "run", settings, [], progress=True).train_args(0, "model")
    assert (args.count("--final-checkpoint") == 1 and args[args.index("--final-checkpoint") + 1] == "model") is not sets

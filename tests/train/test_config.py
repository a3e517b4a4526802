"""Config: defaults of the issue, YAML round trip, strict keys, flag parsing, the lr schedule, refused
combinations, the template and the shipped example."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import yaml

from rollshard.train.backends.schedule import lr_factor
from rollshard.train.config import LossConfig, TrainConfig, add_config_flags, resolve


def parse(*argv: str) -> TrainConfig:
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    add_config_flags(p)
    return resolve(p.parse_args(["--data", "d", "--model", "m", "--out", "o", *argv]))


def test_defaults_are_bypass_dapo_eps_token_mean():
    c = parse()
    assert (c.loss.mode, c.loss.eps_low, c.loss.eps_high, c.loss.agg) == ("bypass", 0.2, 0.28, "token-mean")
    assert c.loss.ratio_level == "token" and c.loss.kl_coef == 0.0 and c.advantage.normalize_std


def test_flags_parse_to_field_types():
    c = parse("--agents", "solver,selector", "--max-staleness", "2", "--no-normalize-std", "--betas", "0.9,0.95",
              "--dual-clip-c", "none", "--ratio-level", "sequence", "--mode", "decoupled", "--max-grad-norm", "0.5")
    assert c.data.agents == ("solver", "selector") and c.data.max_staleness == 2
    assert c.advantage.normalize_std is False and c.optim.betas == (0.9, 0.95)
    assert c.loss.dual_clip_c is None and c.loss.ratio_level == "sequence" and c.optim.max_grad_norm == 0.5


def test_yaml_then_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("loss:\n  eps_high: 0.4\n  mode: decoupled\noptim:\n  lr: 0.1\n")
    c = parse("--config", str(f), "--lr", "0.2")
    assert c.loss.eps_high == 0.4 and c.loss.mode == "decoupled" and c.optim.lr == 0.2
    assert TrainConfig.from_dict(TrainConfig.from_yaml(f).to_dict()) == TrainConfig.from_yaml(f)
    back = tmp_path / "back.yaml"
    back.write_text(c.to_yaml())
    assert TrainConfig.from_yaml(back) == c


@pytest.mark.parametrize(
    "d,message",
    [
        ({"losss": {}}, "unknown section"),
        ({"loss": {"eps_hi": 0.3}}, "unknown key"),
        ({"loss": {"agg": "mean"}}, "loss.agg"),
        ({"data": {"groups_per_step": "many"}}, "data.groups_per_step"),
    ],
)
def test_unknown_or_bad_values_name_the_key(d, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict(d)


def test_lr_schedule_worked_values():
    # warmup 4: 1/4, 2/4, 3/4, 4/4; then linear from 1 at update 4 to min 0.1 at update 14 (span 10).
    assert [lr_factor(u, warmup=4, total=14, decay="linear", min_ratio=0.1) for u in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(9, warmup=4, total=14, decay="linear", min_ratio=0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(20, warmup=4, total=14, decay="linear", min_ratio=0.1) == pytest.approx(0.1)
    # cosine half way: 0.5 * (1 + cos(pi / 2)) = 0.5
    assert lr_factor(5, warmup=0, total=10, decay="cosine", min_ratio=0.0) == pytest.approx(0.5)
    assert lr_factor(0, warmup=0, total=10, decay="cosine", min_ratio=0.0) == pytest.approx(1.0)
    assert lr_factor(123, warmup=0, total=None, decay="constant", min_ratio=0.0) == 1.0
    with pytest.raises(ValueError, match="--decay-steps"):
        lr_factor(5, warmup=0, total=None, decay="cosine", min_ratio=0.0)
    assert math.isclose(lr_factor(10, warmup=0, total=10, decay="cosine", min_ratio=0.2), 0.2)


def test_clip_eps_resolve_by_ratio_level(tmp_path, capsys):
    from rollshard.train.cli import build_parser, main

    assert LossConfig().eps_low is None and LossConfig().eps_high is None  # unset until resolved
    gspo = parse("--ratio-level", "sequence", "--mode", "decoupled")
    assert (gspo.loss.eps_low, gspo.loss.eps_high) == (3e-4, 4e-4)
    assert (parse().loss.eps_low, parse().loss.eps_high) == (0.2, 0.28)
    mixed = parse("--ratio-level", "sequence", "--mode", "decoupled", "--eps-high", "0.001").loss
    assert (mixed.eps_low, mixed.eps_high) == (3e-4, 0.001)
    # A YAML file that sets the level (and no eps) resolves the same way; flags still override.
    f = tmp_path / "c.yaml"
    f.write_text("loss:\n  ratio_level: sequence\n  mode: decoupled\n")
    from_file = parse("--config", str(f)).loss
    assert (from_file.eps_low, from_file.eps_high) == (3e-4, 4e-4)
    assert parse("--config", str(f), "--ratio-level", "token").loss.eps_high == 0.28
    # The resolved config (written next to every checkpoint, --print-config) shows the values.
    argv = ["--data", "d", "--model", "m", "--out", "o", "--ratio-level", "sequence", "--mode", "decoupled"]
    assert main([*argv, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["loss"]
    assert (printed["eps_low"], printed["eps_high"]) == (3e-4, 4e-4)
    help_text = " ".join(build_parser().format_help().split())
    assert "default 0.2 with --ratio-level token, 3e-4 with sequence (GSPO)" in help_text
    eps_low_help = help_text.split("PPO / CISPO clip: ratio lower bound", 1)[1].split("--eps-high", 1)[0]
    assert "(default: None)" not in eps_low_help


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.yaml"


def test_gspo_in_bypass_mode_is_refused_in_one_line(capsys):
    from rollshard.train.cli import main

    with pytest.raises(ValueError, match="use --mode decoupled"):
        parse("--ratio-level", "sequence")
    assert main(["--data", "d", "--model", "m", "--out", "o", "--ratio-level", "sequence"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rollshard-train: error: --ratio-level sequence") and "\n" not in err


def test_help_says_what_zero_variance_and_versions_mean():
    from rollshard.train.cli import build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert "skip groups of two or more rows whose rewards are all equal" in help_text
    assert "one-row groups are kept" in help_text
    assert "default: the weight_version of a rollshard checkpoint folder, else 0" in help_text
    assert "sampling.max_new_tokens x model turns per row" in help_text
    assert parse().trainer.initial_version is None  # resolved by the trainer, from the model folder


def test_print_config_needs_no_data_or_model(capsys):
    from rollshard.train.cli import main

    assert main(["--print-config", "--lr", "0.5"]) == 0
    printed = TrainConfig.from_dict(yaml.safe_load(capsys.readouterr().out))
    assert printed.optim.lr == 0.5 and printed.data.path == "" and printed.loss.eps_high == 0.28
    assert main(["--lr", "0.5"]) == 2  # a run still needs them
    assert "--data" in capsys.readouterr().err


def test_example_config_lists_every_field_and_loads(capsys):
    from rollshard.train.cli import main

    raw = yaml.safe_load(EXAMPLE.read_text())
    defaults = TrainConfig().to_dict()
    assert {k: set(v) for k, v in raw.items()} == {k: set(v) for k, v in defaults.items()}
    example = TrainConfig.from_yaml(EXAMPLE)
    assert example.data.path and example.model.path and example.trainer.out  # a runnable starting point
    assert main(["--config", str(EXAMPLE), "--print-config"]) == 0
    assert TrainConfig.from_dict(yaml.safe_load(capsys.readouterr().out)) == example.validate()


def test_renormalize_support_is_on_by_default_and_has_a_no_flag():
    assert parse().loss.renormalize_support is True
    assert parse("--no-renormalize-support").loss.renormalize_support is False
    assert TrainConfig.from_dict({"loss": {"renormalize_support": "false"}}).loss.renormalize_support is False


def test_micro_batch_support_flag_none_by_default_and_positive():
    assert parse().data.micro_batch_support is None  # the loader's 64 x --micro-batch-tokens
    assert parse("--micro-batch-support", "4194304").data.micro_batch_support == 2**22
    assert parse("--micro-batch-support", "4096", "--micro-batch-support", "none").data.micro_batch_support is None
    with pytest.raises(ValueError, match="--micro-batch-support: > 0 or none"):
        parse("--micro-batch-support", "0")

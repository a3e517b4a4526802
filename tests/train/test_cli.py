"""rollshard-train on the command line: config file + flags, errors, and kill -9 then --resume."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import yaml
from safetensors.torch import load_file

from rollshard.train.checkpoint import CONFIG_FILE, latest_checkpoint
from rollshard.train.cli import main
from rollshard.train.metrics import read_metrics
from tests.gated_main import Gate, start_gated, wait_for_gate


def args_for(data, model, out, *extra):
    return [
        "--data", str(data), "--model", str(model), "--out", str(out), "--groups-per-step", "2",
        "--micro-batch-tokens", "128", "--lr", "1e-3", "--no-progress", "--no-tensorboard", *map(str, extra),
    ]


def test_config_file_and_flags(tiny_dataset, tiny_gpt2, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"loss": {"eps_high": 0.3, "agg": "seq-mean-token-mean"}, "optim": {"lr": 0.5}}))
    out = tmp_path / "run"
    assert main(["--config", str(cfg), *args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", "1")]) == 0
    saved = yaml.safe_load((latest_checkpoint(out).path / CONFIG_FILE).read_text())
    assert saved["loss"]["eps_high"] == 0.3 and saved["loss"]["agg"] == "seq-mean-token-mean"  # from the file
    assert saved["optim"]["lr"] == 1e-3  # the flag overrides the file
    assert saved["loss"]["mode"] == "bypass" and saved["loss"]["eps_low"] == 0.2  # defaults
    assert "1 steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "m", "--out", "o"], "--data"),
        (["--data", "d", "--model", "m", "--out", "o", "--eps-low", "1.5"], "--eps-low"),
        (["--data", "d", "--model", "m", "--out", "o", "--dual-clip-c", "0.5"], "--dual-clip-c"),
    ],
)
def test_usage_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rollshard-train: error:") and message in err and "\n" not in err


def test_missing_dataset_is_a_clear_error(tiny_gpt2, tmp_path, capsys):
    assert main(args_for(tmp_path / "nowhere", tiny_gpt2, tmp_path / "run")) == 2
    assert "no rollshard dataset" in capsys.readouterr().err


def test_killed_run_resumes_to_the_same_losses(tiny_dataset, tiny_gpt2, tmp_path):
    steps = 10
    common = ["--max-steps", steps, "--num-epochs", 3, "--save-every", 1, "--keep-last", 2]
    # Uninterrupted reference, in process.
    assert main(args_for(tiny_dataset, tiny_gpt2, tmp_path / "ref", *common)) == 0
    reference = read_metrics(tmp_path / "ref")
    assert [r["step"] for r in reference] == list(range(1, steps + 1))

    # The same run as a real process, gated after its second checkpoint is saved, then killed with SIGKILL.
    out = tmp_path / "killed"
    gate = Gate("rollshard.train.trainer:save_checkpoint", 2, str(tmp_path / "at-step-2"))
    proc = start_gated(
        [gate], "rollshard.train", *args_for(tiny_dataset, tiny_gpt2, out, *common),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_gate(proc, gate)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and latest_checkpoint(out).step == 2

    assert main(args_for(tiny_dataset, tiny_gpt2, out, *common, "--resume")) == 0
    resumed = read_metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    for a, b in zip(reference, resumed):
        assert b["loss/total"] == pytest.approx(a["loss/total"], rel=1e-5, abs=1e-7), a["step"]
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-7), a["step"]
    w_ref = load_file(str(latest_checkpoint(tmp_path / "ref").path / "model.safetensors"))
    w_res = load_file(str(latest_checkpoint(out).path / "model.safetensors"))
    assert max((w_res[k] - w_ref[k]).abs().max().item() for k in w_ref) < 1e-6

"""tests/bench/gpu/check.py, the parts a CPU can run: its arguments, and every step at tiny size with
``rollshard-generate serve`` standing in for SGLang (the GPU run itself needs a GPU machine)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests import forked

CHECK = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def forked_commands(check, monkeypatch):
    """Each command check.py runs or starts (``python -m rollshard...``) as a fork of the test worker's warm server
    (tests/forked.py): the same process, without a fresh import of torch each."""

    def module_argv(cmd: list[str]) -> list[str]:
        assert cmd[:2] == [sys.executable, "-m"], cmd
        return cmd[2:]

    monkeypatch.setattr(check, "run_command", lambda cmd: forked.run(*module_argv(cmd)))
    monkeypatch.setattr(check, "start_command", lambda cmd, log: forked.start(*module_argv(cmd)))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "generate,fly"], "unknown step(s) ['fly']"),
        (["--steps", "train"], "keep generate in --steps"),
        (["--repeat", "0"], "must be >= 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(check, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        check.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]


def test_the_half_billion_config_builds_the_parameters_worked_out(check, tiny_qwen3):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(check.half_b_config(tiny_qwen3))
    # Per layer: q and o 1024 x 2048, k and v 1024 x 1024, MLP 3 x 1024 x 3072, q/k norms 2 x 128, two RMSNorms
    # 2 x 1024 = 15,730,944; x 28 layers, + tied embeddings 1024 x 1024 + final norm 1024 = 441,516,032.
    assert sum(p.numel() for p in model.parameters()) == 441_516_032
    assert model.config.model_type == "qwen3" and model.config.vocab_size == 1024


def test_the_moe_config_builds_the_parameters_worked_out(check, tiny_moe):
    import torch
    from transformers import AutoModelForCausalLM

    from rollshard.store.format.routing import RoutingShape, shape_of_model_config

    config = check.moe_config(tiny_moe)
    assert shape_of_model_config(config) == RoutingShape(layers=8, top_k=4, experts=32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # Per layer: q and o 1024 x 2048, k and v 1024 x 512, 32 experts of 3 x 1024 x 512, the router 32 x 1024, q/k
    # norms 2 x 128, two RMSNorms 2 x 1024 = 55,609,600; x 8 layers, + tied embeddings 1024 x 1024 + final norm 1024.
    assert sum(p.numel() for p in model.parameters()) == 445_926_400


def test_every_step_runs_at_tiny_size_on_the_cpu(check, forked_commands, tmp_path, capsys):
    argv = [
        "--tiny", "--device", "cpu", "--server", "serve", "--prompts", "2", "--n-samples", "2", "--concurrency", "4",
        "--max-new-tokens", "8", "--repeat", "1", "--batch", "4", "--new-tokens", "8", "--out", str(tmp_path),
        "--async-steps", "4", "--steps", "generate,train,embedded,async",  # moe: the test below
    ]  # fmt: skip
    assert check.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["model"]["params"] == 139_648  # tiny-qwen3
    gen = report["generate"]
    assert gen["requests"] == 4 and gen["failed"] == 0 and gen["runner_tok_s"] > 0 and gen["bare_tok_s"] > 0
    # fp32 on the CPU: the trainer's step-0 logprobs are the embedded engine's (1e-5: fp32 batched vs packed).
    train = report["train"]
    assert train["dtype"] == "float32" and train["fp32_lm_head"] is True
    assert train["abs_diff_max"] <= 1e-5 and train["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    for wl in ("equal", "mixed"):
        assert report["embedded"][wl]["generate_tok_s"] > 0 and report["embedded"][wl]["embedded_tok_s"] > 0
    # 4 steps of 8 groups of 2 samples, each row at most 1 version behind the weights that trained on it
    run = report["async"]
    assert "exit" not in run, run
    assert run["steps"] == 4 and run["rows_trained"] == 64 and run["rows_dropped_stale"] == 0, run
    assert set(run["staleness_hist"]) <= {"0", "1"} and sum(run["staleness_hist"].values()) == 64


def test_the_moe_step_stores_routing_audits_and_replays_at_tiny_size(check, forked_commands, tmp_path, capsys):
    argv = ["--tiny", "--device", "cpu", "--server", "serve", "--steps", "moe", "--prompts", "2", "--n-samples", "2",
            "--concurrency", "4", "--max-new-tokens", "8", "--out", str(tmp_path)]  # fmt: skip
    assert check.main(argv) == 0
    moe = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["moe"]
    assert moe["routing"] == {"experts": 4, "layers": 2, "top_k": 2} and moe["layers_x_top_k"] == 4
    assert 0 < moe["column_bytes_per_position"] <= 4
    # serve in fp32 on the CPU: the trainer routes as the engine did (but where rounding decides a near tie), and
    # with replay its logprobs are the engine's to fp32 rounding.
    audit = moe["audit"]
    assert audit["agreement"] >= 0.95 and audit["replay_max"] < 1e-4
    assert moe["train"]["routing/agreement"] >= 0.95 and moe["train"]["mismatch/abs_diff_max"] < 1e-4

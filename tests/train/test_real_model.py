"""A real pretrained model through the pipeline: SmolLM2-135M-Instruct (``init-model --preset
smollm2-135m-instruct``) generates on the arithmetic task and trains two steps from its rows.

Its logits reach 33 nats over a 49,152-token vocabulary, where the random test models' stay near uniform: the
start-up model check must pass it, and the trainer's first step must recompute the engine's logprobs to fp32
rounding (measured 1.8e-5 max over the first step's tokens).
"""

from __future__ import annotations

import polars as pl
import pytest

from rollshard.train.checkpoint import latest_checkpoint
from rollshard.train.cli import main as train_main
from rollshard.train.metrics import read_metrics

pytestmark = pytest.mark.slow

FP32_REAL_TOL = 1e-4  # engine (batched, KV cache) vs the trainer's packed forward at a real model's logit scale


def test_smollm2_generates_arithmetic_and_trains_two_steps(smollm2, tmp_path, capsys):
    from rollshard.generate.run import main as generate_main

    argv = [
        "--engine", f"embedded:{smollm2}", "--task", "arithmetic", "--limit", "4", "--n-samples", "4",
        "--max-new-tokens", "32", "--out", tmp_path / "data", "--no-progress",
    ]  # fmt: skip
    assert generate_main(list(map(str, argv))) == 0
    rows = pl.read_parquet(f"{tmp_path / 'data'}/shards/*.parquet")
    assert len(rows) == 16 and rows["group_id"].n_unique() == 4
    assert rows["prompt_text"].str.contains("<|im_start|>assistant\n", literal=True).all()  # its own chat template
    assert set(rows["reward"].to_list()) <= {0.0, 1.0}

    argv = [
        "--data", tmp_path / "data", "--model", smollm2, "--out", tmp_path / "run", "--groups-per-step", "2",
        "--max-steps", "2", "--lr", "1e-5", "--no-progress", "--no-tensorboard",
    ]  # fmt: skip
    assert train_main(list(map(str, argv))) == 0
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    m0 = metrics[0]
    print(f"SmolLM2 step 0: |logp - rollout_logp| mean {m0['mismatch/abs_diff_mean']:.2e} max {m0['mismatch/abs_diff_max']:.2e}")
    assert m0["mismatch/abs_diff_max"] <= FP32_REAL_TOL
    assert latest_checkpoint(tmp_path / "run").weight_version == "2"
    assert "step-0 mismatch" in capsys.readouterr().err

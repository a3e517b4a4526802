"""Sampling-aware ratios end to end: rollshard-generate with top-k / top-p stores each token's support, and
rollshard-train's step-0 ratio against it is 1 (weights unchanged), while the full-softmax ratio against the
sampling logprobs sits at the kept probability mass.

Embedded engine here (fp32, same model: within 1e-5); the real SGLang server in test_sglang_loop.py (1e-4).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from rollshard.train.cli import main as train_main
from rollshard.train.metrics import read_metrics

EMBEDDED_TOL = 1e-5


def generate(engine: str, out: Path, *sampling: str) -> pl.DataFrame:
    from rollshard.generate.run import main as generate_main

    argv = [
        "--engine", engine, "--agents", "single", "--task", "toy", "--n-samples", "4", "--max-new-tokens", "12",
        "--limit", "8", "--out", str(out), "--no-progress", *sampling,
    ]  # fmt: skip
    assert generate_main(argv) == 0
    return pl.read_parquet(f"{out}/shards/*.parquet")


def step0(data: Path, model: Path, out: Path, *extra: str) -> dict:
    argv = [
        "--data", data, "--model", model, "--out", out, "--groups-per-step", "8", "--max-steps", "1", "--lr", "1e-3",
        "--no-progress", "--no-tensorboard", *extra,
    ]  # fmt: skip
    assert train_main(list(map(str, argv))) == 0
    return read_metrics(out)[0]


def check_step0(rows: pl.DataFrame, data: Path, model: Path, out: Path, tol: float) -> dict:
    assert rows["sampling_support"].null_count() == 0 and rows["sampling_logprobs"].null_count() == 0
    m = step0(data, model, out / "on")
    assert m["support/tokens"] == 1.0  # every trained token has its support
    assert m["ratio/mean"] == pytest.approx(1.0, abs=tol) and m["support/abs_diff_max"] <= tol
    # Full softmax against the truncated distribution: the trainer's mass on the support, below 1.
    assert m["support/ratio_unrenormalized_mean"] == pytest.approx(m["support/mass_mean"], abs=10 * tol)
    assert m["support/ratio_unrenormalized_mean"] < 0.95
    off = step0(data, model, out / "off", "--no-renormalize-support")
    assert off["ratio/mean"] == pytest.approx(1.0, abs=tol)  # full against full (rollout_logprobs): also 1
    print(
        f"step 0: ratio {m['ratio/mean']:.7f}, max |logp_S - sampling_logp| {m['support/abs_diff_max']:.2e}, "
        f"unrenormalized {m['support/ratio_unrenormalized_mean']:.4f} (mass {m['support/mass_mean']:.4f})"
    )
    return m


@pytest.mark.parametrize("sampling", [("--top-k", "20"), ("--top-p", "0.8"), ("--top-p", "0.8", "--top-k", "50")])
def test_embedded_step0_ratio_over_the_support_is_one(tiny_gpt2, tmp_path, sampling):
    rows = generate(f"embedded:{tiny_gpt2}", tmp_path / "data", *sampling)
    check_step0(rows, tmp_path / "data", tiny_gpt2, tmp_path / "run", EMBEDDED_TOL)


def test_without_truncation_no_support_is_stored(tiny_gpt2, tmp_path):
    rows = generate(f"embedded:{tiny_gpt2}", tmp_path / "data")
    assert rows["sampling_support"].null_count() == rows.height
    m = step0(tmp_path / "data", tiny_gpt2, tmp_path / "run")
    assert m["support/tokens"] == 0.0 and m["ratio/mean"] == pytest.approx(1.0, abs=EMBEDDED_TOL)


def test_the_support_budget_reaches_the_loader(tiny_gpt2, tmp_path):
    """--micro-batch-support bounds the support ids of a micro-batch: top-k 20 rows split into more micro-batches,
    and the step is the same step (ratio over the support still 1)."""
    generate(f"embedded:{tiny_gpt2}", tmp_path / "data", "--top-k", "20")
    whole = step0(tmp_path / "data", tiny_gpt2, tmp_path / "whole")
    split = step0(tmp_path / "data", tiny_gpt2, tmp_path / "split", "--micro-batch-support", "400")
    assert whole["data/micro_batches"] == 1 and split["data/micro_batches"] > 4
    assert split["ratio/mean"] == pytest.approx(1.0, abs=EMBEDDED_TOL)
    assert split["loss/policy"] == pytest.approx(whole["loss/policy"], abs=1e-6)

"""Metric accumulation over micro-batches and ranks; JSONL truncation on resume."""

from __future__ import annotations

import json

import pytest

from rollshard.train.metrics import MetricAccumulator, MetricsLogger, loss_metric_kind, mean_std, read_metrics


def test_kinds_of_loss_metrics():
    assert [loss_metric_kind(k) for k in ("loss/policy", "tokens", "ratio/min", "mismatch/abs_diff_max", "ratio/mean")] == [
        "sum", "sum", "min", "max", "mean",
    ]


def test_merge_of_micro_batches_and_ranks():
    a, b = MetricAccumulator(), MetricAccumulator()
    # micro-batch 1: 3 tokens, ratio mean 1.0; micro-batch 2: 1 token, ratio mean 2.0 -> token-weighted 1.25
    a.add_loss_metrics({"loss/policy": 0.5, "ratio/mean": 1.0, "ratio/min": 0.9, "ratio/max": 1.1, "tokens": 3}, 3)
    b.add_loss_metrics({"loss/policy": -0.2, "ratio/mean": 2.0, "ratio/min": 2.0, "ratio/max": 2.0, "tokens": 1}, 1)
    merged = MetricAccumulator.merged([json.loads(json.dumps(a.state())), b.state()]).result()
    assert merged["loss/policy"] == pytest.approx(0.3)
    assert merged["ratio/mean"] == pytest.approx(1.25)
    assert merged["ratio/min"] == 0.9 and merged["ratio/max"] == 2.0 and merged["tokens"] == 4


def test_mean_std_from_sums():
    # values 1, 2, 3: sum 6, sum of squares 14 -> mean 2, population std sqrt(14/3 - 4) = 0.8165
    assert mean_std(6.0, 14.0, 3.0) == pytest.approx((2.0, 0.816496580927726))


def test_resume_drops_records_after_the_checkpoint(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        log.log(step, {"loss/total": float(step)})
    log.close()
    log = MetricsLogger(tmp_path, tensorboard=False, resume_step=2)
    log.log(3, {"loss/total": 30.0})
    log.close()
    assert [(r["step"], r["loss/total"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    log = MetricsLogger(tmp_path, tensorboard=False, resume_step=None)  # a fresh run starts a fresh file
    log.log(1, {"loss/total": float("nan")})
    log.close()
    assert read_metrics(tmp_path) == [{"step": 1, "time": read_metrics(tmp_path)[0]["time"], "loss/total": "nan"}]

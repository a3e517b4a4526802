"""The step's figures read to the host at once, and the shared reductions of token_metrics: the same floats."""

from __future__ import annotations

import torch

from rollshard.train.config import LossConfig
from rollshard.train.losses import token_metrics
from rollshard.train.metrics import to_host


def test_to_host_reads_what_float_reads():
    # float32 values that float64 holds exactly (1/3 in float32 is 0.3333333432674408), an int64 count above
    # float32's 2**24, a bfloat16 and a float64 that float32 would round: one stack in float64 keeps each.
    third = torch.tensor(1.0 / 3.0)  # float32
    metrics = [
        {"loss/policy": third, "tokens": torch.tensor(2**24 + 1)},
        {"ratio/mean": torch.tensor(0.7, dtype=torch.bfloat16), "x": torch.tensor(0.1, dtype=torch.float64)},
        {},
    ]
    got = to_host(metrics)
    assert got == [{name: float(v) for name, v in m.items()} for m in metrics]
    assert got[0] == {"loss/policy": 0.3333333432674408, "tokens": 16777217.0}
    assert got[1]["x"] == 0.1 and got[1]["ratio/mean"] == 0.69921875  # bfloat16's 0.7
    assert [list(m) for m in got] == [["loss/policy", "tokens"], ["ratio/mean", "x"], []]


def test_to_host_of_one_dtype_and_of_nothing():
    metrics = [{"a": torch.tensor(0.1), "b": torch.tensor(-2.5)}, {"a": torch.tensor(float("inf"))}]
    assert to_host(metrics) == [{"a": float(torch.tensor(0.1)), "b": -2.5}, {"a": float("inf")}]
    assert to_host([]) == [] and to_host([{}, {}]) == [{}, {}]


def _inputs():
    g = torch.Generator().manual_seed(0)
    T = 37
    mask = (torch.rand(T, generator=g) > 0.3).float()  # [T]
    logp = -torch.rand(T, generator=g) * 3  # [T]
    rollout = logp + 0.05 * torch.randn(T, generator=g)  # [T]
    ratio = torch.exp(logp - rollout)  # [T]
    adv = torch.randn(T, generator=g) * mask  # [T]
    return logp, rollout, ratio, adv, mask


def test_ratio_as_its_own_weight_gives_the_figures_of_a_copy():
    # Bypass mode passes the ratio as the weight: the figures read from it once equal those of a separate copy.
    logp, rollout, ratio, adv, mask = _inputs()
    kw = dict(rollout_logp=rollout, advantages=adv, mask=mask, config=LossConfig())
    shared = token_metrics(logp, ratio=ratio, is_weight=ratio, is_dropped=None, **kw)
    copied = token_metrics(logp, ratio=ratio, is_weight=ratio.clone(), is_dropped=torch.zeros(37, dtype=torch.bool), **kw)
    assert list(shared) == list(copied)
    assert {k: float(v) for k, v in shared.items()} == {k: float(v) for k, v in copied.items()}
    assert float(shared["is/mean"]) == float(shared["ratio/mean"]) and float(shared["is/frac_dropped"]) == 0.0


def test_min_and_max_equal_the_masked_reductions():
    # ratio/min and ratio/max (one aminmax) against min and max of the valid tokens picked by the mask.
    logp, rollout, ratio, adv, mask = _inputs()
    m = token_metrics(
        logp, rollout_logp=rollout, ratio=ratio, advantages=adv, mask=mask, is_weight=ratio * 2,
        is_dropped=ratio > 1.02, config=LossConfig(),
    )
    on = mask > 0
    assert float(m["ratio/min"]) == float(ratio[on].min()) and float(m["ratio/max"]) == float(ratio[on].max())
    assert float(m["is/min"]) == float((ratio * 2)[on].min()) and float(m["is/max"]) == float((ratio * 2)[on].max())
    assert float(m["is/frac_dropped"]) == float((ratio > 1.02)[on].float().mean())
    assert float(m["tokens"]) == float(on.sum())

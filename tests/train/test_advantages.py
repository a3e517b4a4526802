"""GRPO advantages: worked values for uneven groups, Dr. GRPO, single-member and zero-variance groups."""

from __future__ import annotations

import math

import pytest
import torch

from rollshard.train.advantages import ADV_EPS, grpo_advantages, token_advantages

# Four groups, interleaved on purpose (groups are explicit ids, never row positions):
#   g0: rewards 1, 0, 0.5  -> mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
#   g1: rewards 2, 2       -> zero variance -> advantage exactly 0
#   g2: reward 3           -> single member
#   g3: rewards 0, 1       -> mean 0.5, unbiased std sqrt(0.5) = 0.70710678
REWARDS = torch.tensor([1.0, 2.0, 0.0, 3.0, 0.5, 2.0, 0.0, 1.0])
GROUPS = torch.tensor([0, 1, 0, 2, 0, 1, 3, 3])


def test_grpo_uneven_groups_worked_values():
    out = grpo_advantages(REWARDS, GROUPS, normalize_std=True)
    s3 = math.sqrt(0.5)
    expected = [
        0.5 / (0.5 + ADV_EPS),  # g0, r=1
        0.0,  # g1 zero variance
        -0.5 / (0.5 + ADV_EPS),  # g0, r=0
        3.0 / (1.0 + ADV_EPS),  # g2 single member: verl's mean 0, std 1
        0.0,  # g0, r=0.5 is the mean
        0.0,  # g1
        -0.5 / (s3 + ADV_EPS),  # g3, r=0
        0.5 / (s3 + ADV_EPS),  # g3, r=1
    ]
    torch.testing.assert_close(out.advantages, torch.tensor(expected), atol=1e-7, rtol=0)
    torch.testing.assert_close(out.mean, torch.tensor([0.5, 2.0, 0.0, 0.5]))
    torch.testing.assert_close(out.std, torch.tensor([0.5, 0.0, 1.0, s3]))
    assert out.size.tolist() == [3, 2, 1, 2]
    assert out.zero_variance.tolist() == [False, True, False, False]
    m = out.metrics()
    assert m["adv/frac_zero_var_groups"] == pytest.approx(0.25)
    assert m["adv/frac_single_groups"] == pytest.approx(0.25)


def test_dr_grpo_drops_std():
    out = grpo_advantages(REWARDS, GROUPS, normalize_std=False)
    # r - mean; the single-member group keeps its reward (mean 0), zero-variance groups stay 0.
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, 0.0, -0.5, 3.0, 0.0, 0.0, -0.5, 0.5]))


def test_single_member_zero_option():
    out = grpo_advantages(REWARDS, GROUPS, single_member="zero")
    assert out.advantages[3].item() == 0.0
    assert out.advantages[0].item() == pytest.approx(0.5 / (0.5 + ADV_EPS), abs=1e-7)


def test_zero_variance_is_exactly_zero_despite_float_rounding():
    # 0.1 * 3 / 3 is not exactly 0.1 in float arithmetic; (r - mean) / eps would be ~1e-2, not 0.
    out = grpo_advantages(torch.tensor([0.1, 0.1, 0.1]), torch.tensor([0, 0, 0]))
    assert out.advantages.tolist() == [0.0, 0.0, 0.0]
    assert out.zero_variance.tolist() == [True]


def test_group_without_rows_is_an_error():
    with pytest.raises(ValueError, match="no rows"):
        grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 2]), num_groups=3)


def test_token_broadcast_under_loss_mask():
    # seq0: 3 tokens (prompt, 2 response), seq1: 2 tokens (prompt, 1 response).
    adv = token_advantages(torch.tensor([1.0, -2.0]), torch.tensor([0, 3, 5]), torch.tensor([0.0, 1, 1, 0, 1]))
    assert adv.tolist() == [0.0, 1.0, 1.0, 0.0, -2.0]

"""Advantages (spec §2) and reward metrics (spec §4.1): golden numbers of spec §13.2 and edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lightning.algo import (
    AdvantageResult,
    compute_advantages,
    compute_advantages_with_stats,
    masked_mean,
    nanmax,
    nanmin,
    nanstd,
    reward_metrics,
)
from tests.numerics import assert_close_f32, f32_tolerance

NAN = float("nan")
# The golden numbers are TRL's float32 results printed to 6 decimals; ours are float64 statistics
# rounded once to float32. So: the printing (5e-7) plus TRL's float32 rounding (tests/numerics.py)
# of (r − mean) / std over a batch of 8, whose errors are relative to max |r| / std (3 / 0.5 here).
TOL = 5e-7 + f32_tolerance(reduction_size=8, scale=3 / 0.5)
R = torch.tensor([[1, 0], [0, 1], [1, NAN], [1, 1], [2, NAN], [NAN, NAN], [0.5, 0], [3, 2]])
W = [0.7, 0.3]

GOLDEN = {
    ("sum_then_normalize", "group"): [0.087008, -1.305128, 0.087008, 1.131111, -0.070783, 0.0, -0.962643, 1.033426],
    ("sum_then_normalize", "batch"): [0.030095, -0.451432, 0.030095, 0.391241, -0.100318, 0.0, -1.364326, 1.464645],
    ("sum_then_normalize", "none"): [0.025, -0.375, 0.025, 0.325, -0.083333, 0.0, -1.133333, 1.216667],
    ("normalize_then_sum", "group"): [0.005217, -1.277503, 0.509958, 0.762328, 0.135107, 0.0, -1.389981, 1.254873],
    ("normalize_then_sum", "batch"): [0.005217, -1.277503, 0.509958, 0.762328, 0.135107, 0.0, -1.389981, 1.254873],
    ("normalize_then_sum", "none"): [0.005217, -1.277503, 0.509958, 0.762328, 0.135107, 0.0, -1.389981, 1.254873],
}
GOLDEN_METRICS = {
    "rewards/r1/mean": 1.214286,
    "rewards/r1/std": 0.99403,
    "rewards/r2/mean": 0.8,
    "rewards/r2/std": 0.83666,
    "reward": 1.021428,
    "reward_std": 0.830591,
    "frac_reward_zero_std": 0.0,
}


@pytest.mark.parametrize(("aggregation", "scale"), list(GOLDEN), ids=["/".join(k) for k in GOLDEN])
def test_golden_advantages(aggregation, scale):
    adv = compute_advantages(R, 4, reward_weights=W, scale_rewards=scale, multi_objective_aggregation=aggregation)
    assert adv.shape == (8,)
    assert adv.tolist() == pytest.approx(GOLDEN[(aggregation, scale)], abs=TOL)


@pytest.mark.parametrize(("aggregation", "scale"), list(GOLDEN), ids=["/".join(k) for k in GOLDEN])
def test_golden_metrics(aggregation, scale):
    result = compute_advantages_with_stats(R, 4, W, scale, aggregation)
    metrics = reward_metrics(R, ["r1", "r2"], result)
    assert metrics == pytest.approx(GOLDEN_METRICS, abs=TOL)


def test_result_fields():
    result = compute_advantages_with_stats(R, 4, W)
    assert isinstance(result, AdvantageResult)
    assert result.unscorable.tolist() == [False] * 5 + [True] + [False] * 2
    assert math.isnan(result.weighted_rewards[5].item())
    assert result.weighted_rewards[0].item() == pytest.approx(0.7)
    assert result.weighted_rewards[2].item() == pytest.approx(0.7)  # NaN term skipped
    assert result.zero_std.dtype == torch.bool and not result.zero_std.any()


def test_bool_scale_rewards():
    assert torch.equal(compute_advantages(R, 4, W, True), compute_advantages(R, 4, W, "group"))
    assert torch.equal(compute_advantages(R, 4, W, False), compute_advantages(R, 4, W, "none"))


def test_invalid_settings_name_the_setting_and_choices():
    with pytest.raises(ValueError, match=r"scale_rewards='std'.*'group', 'batch', 'none'"):
        compute_advantages(R, 4, W, "std")
    with pytest.raises(ValueError, match=r"multi_objective_aggregation='mean'.*sum_then_normalize"):
        compute_advantages(R, 4, W, multi_objective_aggregation="mean")
    with pytest.raises(ValueError, match="reward_weights"):
        compute_advantages(R, 4, [1.0])
    with pytest.raises(ValueError, match="num_generations"):
        compute_advantages(R, 3, W)


def test_two_generations_give_plus_minus_0_7071():
    adv = compute_advantages(torch.tensor([[3.0], [1.0], [5.0], [5.0]]), 2)
    half = 1 / (math.sqrt(2) + 1e-4)  # (3 − 2) / (std + 1e-4), std = √2
    assert_close_f32(adv, [half, -half, 0.0, 0.0])  # float64 statistics, rounded once
    result = compute_advantages_with_stats(torch.tensor([[3.0], [1.0], [5.0], [5.0]]), 2)
    assert result.zero_std.tolist() == [False, False, True, True]
    assert reward_metrics(torch.tensor([[3.0], [1.0], [5.0], [5.0]]), ["f"], result)["frac_reward_zero_std"] == 0.5


def test_one_dimensional_rewards_mean_one_function():
    r = torch.tensor([1.0, 2.0, 3.0, 5.0])
    assert torch.equal(compute_advantages(r, 2), compute_advantages(r[:, None], 2))


def test_group_of_one_uses_zero_std():
    # num_generations=1 (possible in eval): the std is 0, advantages are r − r = 0 and zero_std is True
    result = compute_advantages_with_stats(torch.tensor([[1.0], [2.0]]), 1)
    assert result.advantages.tolist() == [0.0, 0.0]
    assert result.zero_std.all()
    gdpo = compute_advantages_with_stats(torch.tensor([[1.0], [2.0]]), 1, multi_objective_aggregation="normalize_then_sum")
    assert gdpo.advantages.tolist() == [0.0, 0.0]


def test_group_with_a_single_scorable_row_gets_zero_advantage():
    r = torch.tensor([[1.0], [NAN], [2.0], [4.0]])
    result = compute_advantages_with_stats(r, 2)
    # group 0: one value → nanstd NaN → advantage NaN → 0; isclose(NaN, 0) is False
    assert result.advantages[:2].tolist() == [0.0, 0.0]
    assert result.zero_std.tolist() == [False, False, False, False]


def test_all_unscorable():
    r = torch.full((4, 2), NAN)
    result = compute_advantages_with_stats(r, 2)
    assert result.advantages.tolist() == [0.0] * 4
    metrics = reward_metrics(r, ["a", "b"], result)
    assert math.isnan(metrics["reward"]) and math.isnan(metrics["rewards/a/mean"])


def test_scale_none_does_not_divide():
    r = torch.tensor([[0.0], [4.0]])
    assert compute_advantages(r, 2, scale_rewards="none").tolist() == [-2.0, 2.0]


@pytest.mark.parametrize(("aggregation", "scale"), list(GOLDEN), ids=["/".join(k) for k in GOLDEN])
def test_huge_finite_rewards_give_the_same_advantages_as_scaled_ones(aggregation, scale):
    # 1e30 squared overflows float32: the statistics must not, or every advantage becomes 0 (or NaN).
    # Reference: the same rewards scaled by 1e6, where float32 is exact enough and the 1e-4 std
    # epsilon is negligible; advantages are scale-free except with scale_rewards="none".
    small = torch.tensor([[1.0], [0.0], [3.0], [2.0], [5.0], [1.0], [0.5], [4.0]])
    huge = compute_advantages_with_stats(small * 1e30, 4, None, scale, aggregation)
    reference = compute_advantages_with_stats(small * 1e6, 4, None, scale, aggregation)
    assert huge.advantages.dtype == torch.float32 and huge.advantages.abs().min() > 0
    unit = 1e30 / 1e6 if (aggregation, scale) == ("sum_then_normalize", "none") else 1.0
    # both float64 statistics rounded once to float32, then the division by unit rounds again
    assert_close_f32(huge.advantages / unit, reference.advantages, reduction_size=2)
    assert huge.zero_std.tolist() == reference.zero_std.tolist()
    metrics = reward_metrics(small * 1e30, ["r"], huge)
    # small · 1e30 rounds each reward to float32; the std's error is relative to max |r| / std
    std = float(nanstd(small[:, 0].double()))
    assert_close_f32(metrics["rewards/r/std"], std * 1e30, scale=1e30 * float(small.abs().max()))
    assert math.isfinite(metrics["reward_std"])


def test_results_keep_the_input_dtype():
    r = torch.tensor([[1.0], [0.0], [3.0], [2.0]])
    assert compute_advantages(r.double(), 2).dtype == torch.float64
    assert compute_advantages(r.bfloat16(), 2).dtype == torch.bfloat16
    assert compute_advantages(r.long(), 2).dtype == torch.float32
    assert compute_advantages_with_stats(r, 2).weighted_rewards.dtype == torch.float32


# ---- stats helpers --------------------------------------------------------------------------------
def test_nanstd_is_unbiased_and_nan_below_two_values():
    assert nanstd(torch.tensor([1.0, 2.0, 3.0, NAN])).item() == pytest.approx(1.0)
    assert math.isnan(nanstd(torch.tensor([1.0, NAN])).item())
    rows = nanstd(torch.tensor([[1.0, 3.0], [2.0, NAN]]), dim=1)
    assert rows[0].item() == pytest.approx(math.sqrt(2)) and math.isnan(rows[1].item())
    assert nanstd(torch.ones(2, 3, 4), dim=(0, 2)).shape == (3,)
    assert nanstd(torch.ones(2, 3), dim=1, keepdim=True).shape == (2, 1)


def test_nanmin_nanmax_and_masked_mean():
    x = torch.tensor([NAN, 3.0, -1.0])
    assert nanmin(x).item() == -1.0 and nanmax(x).item() == 3.0
    assert math.isnan(nanmin(torch.tensor([NAN])).item())
    m = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert masked_mean(torch.tensor([[2.0, 9.0], [9.0, 9.0]]), m).item() == 2.0
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0  # clamped denominator


def test_stats_match_trl_helpers():
    utils = pytest.importorskip("trl.trainer.utils")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=g)
    x[x > 1.0] = NAN
    x[0] = NAN
    for dim in (None, 0, 1):
        ours, theirs = nanstd(x, dim=dim), utils.nanstd(x, dim=dim)
        # both float32 sums over at most 24 values, errors relative to the values' magnitude
        scale = float(x.nan_to_num().abs().max())
        assert_close_f32(ours, theirs, reduction_size=x.numel(), scale=scale, nan_ok=True, msg=f"dim={dim}")
    flat = x.flatten()
    assert torch.equal(nanmin(flat), utils.nanmin(flat)) and torch.equal(nanmax(flat), utils.nanmax(flat))

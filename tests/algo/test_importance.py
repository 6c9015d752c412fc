"""The sampler importance-sampling correction (spec §3.8) against hand-computed ratios."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lightning.algo.importance import (
    ImportanceSamplingCorrection, importance_sampling_weights, sampling_metrics, sampling_stats,
)

# Two rows; row 0 has three loss tokens, row 1 two (its last position is padding).
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -1.0, -7.0]], dtype=torch.float64)
SAMP = torch.tensor([[-1.5, -1.0, -0.5], [-1.4, -1.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# d = (old - samp) * mask = [[0.5, -1.0, 0.0], [1.2, 0.0, 0.0]]
TOKEN_RATIOS = [[math.exp(0.5), math.exp(-1.0), 1.0], [math.exp(1.2), 1.0, 1.0]]  # 1.6487, 0.3679, 1; 3.3201, 1, 1
SEQUENCE_RATIOS = [math.exp(-0.5), math.exp(1.2)]  # 0.6065, 3.3201


def weights(mode, clip_min=None, clip_max=3.0):
    correction = ImportanceSamplingCorrection(mode=mode, clip_min=clip_min, clip_max=clip_max)
    return importance_sampling_weights(OLD, SAMP, MASK, correction)


def clamp(x, low, high):
    return min(max(x, -math.inf if low is None else low), math.inf if high is None else high)


def drop(x, low, high):
    return 0.0 if (low is not None and x < low) or (high is not None and x > high) else x


BOUNDS = [(None, 3.0), (0.5, None), (0.5, 5.0), (0.4, 1.5)]


@pytest.mark.parametrize("clip_min, clip_max", BOUNDS)
def test_token_modes(clip_min, clip_max):
    truncated = weights("token_truncate", clip_min, clip_max)
    masked = weights("token_mask", clip_min, clip_max)
    assert truncated.shape == masked.shape == (2, 3)
    expected_truncated = [[clamp(r, clip_min, clip_max) for r in row] for row in TOKEN_RATIOS]
    expected_masked = [[drop(r, clip_min, clip_max) for r in row] for row in TOKEN_RATIOS]
    torch.testing.assert_close(truncated, torch.tensor(expected_truncated, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(masked, torch.tensor(expected_masked, dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("clip_min, clip_max", BOUNDS)
def test_sequence_modes_use_the_product_of_token_ratios(clip_min, clip_max):
    truncated = weights("sequence_truncate", clip_min, clip_max)
    masked = weights("sequence_mask", clip_min, clip_max)
    assert truncated.shape == masked.shape == (2, 1)
    expected_truncated = [[clamp(r, clip_min, clip_max)] for r in SEQUENCE_RATIOS]
    expected_masked = [[drop(r, clip_min, clip_max)] for r in SEQUENCE_RATIOS]
    torch.testing.assert_close(truncated, torch.tensor(expected_truncated, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(masked, torch.tensor(expected_masked, dtype=torch.float64), rtol=1e-12, atol=0)


def test_default_is_sequence_mask_with_cap_3_and_no_floor():
    correction = ImportanceSamplingCorrection()
    assert (correction.enabled, correction.mode, correction.clip_min, correction.clip_max) == (True, "sequence_mask", None, 3.0)
    # Row 1's product 3.32 exceeds 3: the whole sequence is dropped; row 0 (0.61) is kept.
    torch.testing.assert_close(
        importance_sampling_weights(OLD, SAMP, MASK, correction), torch.tensor([[math.exp(-0.5)], [0.0]], dtype=torch.float64)
    )


def test_masked_tokens_never_move_a_ratio():
    huge_gap_on_padding = SAMP.clone()
    huge_gap_on_padding[1, 2] = 500.0  # a padding position: exp(-507) would underflow if it counted
    out = importance_sampling_weights(OLD, huge_gap_on_padding, MASK, ImportanceSamplingCorrection(mode="sequence_truncate", clip_max=None, clip_min=0.0))
    assert out[1, 0].item() == pytest.approx(math.exp(1.2))


def test_float32_inputs_give_float32_weights_computed_in_float64():
    # 4000 tokens each off by 1e-4: the sequence log-ratio 0.4 must not drift in float32 sums.
    old = torch.full((1, 4000), -2.0)
    samp = old - 1e-4
    out = importance_sampling_weights(old, samp, torch.ones(1, 4000), ImportanceSamplingCorrection(mode="sequence_truncate", clip_max=10.0))
    assert out.dtype == torch.float32
    exact = math.exp((old.double() - samp.double()).sum().item())  # the float32 inputs' own gap, summed exactly
    assert out.item() == pytest.approx(exact, rel=2 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "tokens"}, "mode='tokens'"),
        ({"clip_min": None, "clip_max": None}, "both null"),
        ({"clip_min": 4.0, "clip_max": 3.0}, "above clip_max"),
        ({"clip_min": -1.0}, "clip_min=-1.0"),
    ],
)
def test_bad_settings_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match="data.importance_sampling") as err:
        ImportanceSamplingCorrection(**kwargs)
    assert message in str(err.value)


def test_metrics_token_mode_over_loss_tokens_of_all_ranks():
    w = weights("token_truncate", None, 3.0)  # row 1 token 0: 3.32 -> 3.0
    stats = sampling_stats(OLD, SAMP, MASK, w, per_sequence=False)
    gaps = [0.5, 1.0, 0.0, 1.2, 0.0]  # |d| over the five loss tokens
    ratios = [math.exp(0.5), math.exp(-1.0), 1.0, 3.0, 1.0]
    assert stats.token_count == 5 and stats.ratio_count == 5
    # A second rank with one token of gap 2.0 and ratio 0.1.
    other = torch.tensor([[2.0, 2.0, 1, 0.1, 1, 0.1, 0.1]], dtype=torch.float64)
    metrics = sampling_metrics(torch.cat([stats.as_tensor()[None], other]))
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx((sum(gaps) + 2.0) / 6)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(2.0)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx((sum(ratios) + 0.1) / 6)
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(0.1)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)


def test_metrics_sequence_mode_over_counted_sequences():
    w = weights("sequence_mask", None, 3.0)  # [0.6065, 0]
    metrics = sampling_metrics(sampling_stats(OLD, SAMP, MASK, w, per_sequence=True).as_tensor()[None])
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(-0.5) / 2)
    assert metrics["sampling/importance_sampling_ratio/min"] == 0.0
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(-0.5))
    # Rows that do not count (evaluation repeats) are left out of every statistic.
    only_row_0 = sampling_metrics(
        sampling_stats(OLD, SAMP, MASK, w, per_sequence=True, rows=torch.tensor([True, False])).as_tensor()[None]
    )
    assert only_row_0["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(-0.5))
    assert only_row_0["sampling/sampling_logp_difference/max"] == pytest.approx(1.0)


def test_metrics_without_any_token_are_nan_not_errors():
    empty = sampling_stats(OLD, SAMP, torch.zeros_like(MASK), weights("token_mask"), per_sequence=False)
    metrics = sampling_metrics(empty.as_tensor()[None])
    assert all(math.isnan(v) for v in metrics.values())


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate", "token_mask", "sequence_mask"])
def test_a_token_the_sampler_could_not_score_gets_ratio_one_and_no_gap(mode):
    """A NaN sampler log-prob (TRL: vLLM could not score the token) is no correction (d = 0) and is
    left out of the gap metrics, as in TRL; it never turns a weight or a metric into NaN."""
    samp = SAMP.clone()
    samp[0, 1] = float("nan")  # d was -1.0 there
    correction = ImportanceSamplingCorrection(mode=mode, clip_max=5.0)
    w = importance_sampling_weights(OLD, samp, MASK, correction)
    d = [[0.5, 0.0, 0.0], [1.2, 0.0, 0.0]]
    expected = [[math.exp(x) for x in row] for row in d]
    if correction.per_sequence:
        expected = [[math.exp(sum(row))] for row in d]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    stats = sampling_stats(OLD, samp, MASK, w, per_sequence=correction.per_sequence)
    assert stats.token_count == 4  # the NaN token is not a gap of 0
    assert stats.difference_sum == pytest.approx(0.5 + 0.0 + 1.2 + 0.0)


def test_one_token_completions_in_token_mode_count_only_loss_tokens():
    """Token-mode weights of one-token completions are ``(B, 1)`` like sequence-mode ones: the
    mode, not the shape, says how to count them (row 1's single position is masked)."""
    old, samp, mask = OLD[:, :1], SAMP[:, :1], torch.tensor([[1], [0]])
    w = importance_sampling_weights(old, samp, mask, ImportanceSamplingCorrection(mode="token_truncate"))
    stats = sampling_stats(old, samp, mask, w, per_sequence=False)
    assert stats.ratio_count == 1 and stats.ratio_sum == pytest.approx(math.exp(0.5))

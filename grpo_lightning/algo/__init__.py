"""Foundations: tensor math shared by the data side and the losses (torch + stdlib only)."""

from grpo_lightning.algo.advantages import (
    AGGREGATION_CHOICES,
    SCALE_REWARDS_CHOICES,
    AdvantageResult,
    compute_advantages,
    compute_advantages_with_stats,
    normalize_scale_rewards,
    reward_metrics,
)
from grpo_lightning.algo.stats import masked_mean, masked_sum, nanmax, nanmin, nanstd

__all__ = [
    "AGGREGATION_CHOICES",
    "SCALE_REWARDS_CHOICES",
    "AdvantageResult",
    "compute_advantages",
    "compute_advantages_with_stats",
    "masked_mean",
    "masked_sum",
    "nanmax",
    "nanmin",
    "nanstd",
    "normalize_scale_rewards",
    "reward_metrics",
]

"""Group-relative advantages from a reward matrix (TRL ``GRPOTrainer``, spec §2).

Layer L0: torch and the standard library only. Rows are group-major: the ``G`` completions of a
prompt are consecutive, so ``rewards.view(-1, G, F)`` groups them. ``NaN`` in the reward matrix
means "this function does not apply to this completion"; a row that is NaN everywhere is
unscorable and gets advantage 0.

The statistics are computed in float64 whatever the input dtype (results are cast back), so that
large but finite rewards (say 1e30, whose square overflows float32) still give exact advantages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from grpo_lightning.algo.stats import nanstd

ScaleRewards = Literal["group", "batch", "none"]
Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]

SCALE_REWARDS_CHOICES = ("group", "batch", "none")
AGGREGATION_CHOICES = ("sum_then_normalize", "normalize_then_sum")
STD_EPSILON = 1e-4  # added to the std, not inside a square root (TRL)


@dataclass
class AdvantageResult:
    """Advantages plus what the generation-side metrics need, computed once.

    Attributes:
        advantages: ``(N,)`` advantages; 0 for unscorable rows.
        weighted_rewards: ``(N,)`` ``Σ_f w_f R_f`` (NaN terms skipped), NaN for unscorable rows.
            This is what the ``reward``/``reward_std`` metrics average.
        zero_std: ``(N,)`` bool, ``isclose(σ_i, 0)`` with σ the std used for scaling (group std,
            batch std, or the GDPO batch std); feeds ``frac_reward_zero_std``.
        unscorable: ``(N,)`` bool, rows where every reward function returned NaN/None.
    """

    advantages: torch.Tensor
    weighted_rewards: torch.Tensor
    zero_std: torch.Tensor
    unscorable: torch.Tensor


def normalize_scale_rewards(scale_rewards: str | bool) -> str:
    """Map TRL's accepted ``scale_rewards`` values to ``"group" | "batch" | "none"``.

    ``True`` means ``"group"`` and ``False`` means ``"none"``, as in ``GRPOConfig``.

    >>> normalize_scale_rewards(True), normalize_scale_rewards(False), normalize_scale_rewards("batch")
    ('group', 'none', 'batch')
    """
    if scale_rewards is True:
        return "group"
    if scale_rewards is False:
        return "none"
    if scale_rewards not in SCALE_REWARDS_CHOICES:
        raise ValueError(
            f"scale_rewards={scale_rewards!r} is not valid. Choose one of {list(SCALE_REWARDS_CHOICES)} "
            "(or True for 'group', False for 'none')."
        )
    return scale_rewards


def _float64(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float64 for the statistics; MPS has no float64, so those go through the CPU."""
    if tensor.device.type == "mps":
        tensor = tensor.cpu()
    return tensor.double()


def _check_inputs(
    rewards: torch.Tensor, num_generations: int, reward_weights: torch.Tensor | Sequence[float] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, F)`` float64 rewards and ``(F,)`` float64 weights, checked."""
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(1)  # a single reward source
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape (N, F); got {tuple(rewards.shape)}.")
    if num_generations < 1:
        raise ValueError(f"num_generations={num_generations}: it must be at least 1.")
    if rewards.shape[0] % num_generations != 0:
        raise ValueError(
            f"The number of reward rows ({rewards.shape[0]}) is not a multiple of "
            f"num_generations={num_generations}: rows must be whole groups, group-major."
        )
    rewards = _float64(rewards)
    if reward_weights is None:
        weights = torch.ones(rewards.shape[1], dtype=torch.float64, device=rewards.device)
    else:
        weights = _float64(torch.as_tensor(reward_weights)).to(rewards.device)
        if weights.shape != (rewards.shape[1],):
            raise ValueError(
                f"reward_weights has {weights.numel()} entries but there are {rewards.shape[1]} reward "
                "functions: give one weight per reward function."
            )
    return rewards, weights


def compute_advantages_with_stats(
    rewards: torch.Tensor,
    num_generations: int,
    reward_weights: torch.Tensor | Sequence[float] | None = None,
    scale_rewards: ScaleRewards | bool = "group",
    multi_objective_aggregation: Aggregation = "sum_then_normalize",
) -> AdvantageResult:
    """Advantages as TRL computes them, with the by-products needed for reward metrics.

    Args:
        rewards: ``(N, F)`` reward matrix (``N`` = groups x ``num_generations``, group-major);
            NaN where a function returned ``None``. A 1-D ``(N,)`` tensor means ``F = 1``.
        num_generations: ``G``, completions per prompt (the group size).
        reward_weights: ``(F,)`` per-function weights; ``None`` means all ones.
        scale_rewards: ``"group"`` divides by the group std, ``"batch"`` by the std over all ``N``
            rows, ``"none"`` does not divide. ``True``/``False`` mean ``"group"``/``"none"``.
            Ignored by ``"normalize_then_sum"`` (always batch-normalised, as in TRL).
        multi_objective_aggregation: ``"sum_then_normalize"`` (weighted sum, then group-relative)
            or ``"normalize_then_sum"`` (GDPO: normalise each function within its group, then sum
            and normalise over the batch).

    Returns:
        An :class:`AdvantageResult`.

    >>> r = torch.tensor([[1.0], [0.0], [2.0], [2.0]])
    >>> compute_advantages_with_stats(r, 2).zero_std.tolist()
    [False, False, True, True]
    """
    scale = normalize_scale_rewards(scale_rewards)
    if multi_objective_aggregation not in AGGREGATION_CHOICES:
        raise ValueError(
            f"multi_objective_aggregation={multi_objective_aggregation!r} is not valid. Choose one of "
            f"{list(AGGREGATION_CHOICES)}."
        )
    device = rewards.device
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    rewards, weights = _check_inputs(rewards, num_generations, reward_weights)  # float64
    n, f = rewards.shape
    g = num_generations
    unscorable = torch.isnan(rewards).all(dim=1)  # (N,)
    weighted = (rewards * weights.unsqueeze(0)).nansum(dim=1)  # (N,)
    weighted[unscorable] = float("nan")

    if multi_objective_aggregation == "sum_then_normalize":
        group_mean = torch.nanmean(weighted.view(-1, g), dim=1).repeat_interleave(g)  # (N,)
        if scale in ("group", "none"):
            # With "none" the group std is still needed for zero_std (logging only).
            if g > 1:
                std = nanstd(weighted.view(-1, g), dim=1).repeat_interleave(g)
            else:
                std = torch.zeros_like(weighted)
        else:  # batch
            std = nanstd(weighted).expand_as(weighted) if n > 1 else torch.zeros_like(weighted)
        advantages = weighted - group_mean
        if scale != "none":
            advantages = advantages / (std + STD_EPSILON)
    else:  # normalize_then_sum (GDPO)
        grouped = rewards.view(-1, g, f)  # (N/G, G, F)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
        z = ((grouped - mean_k) / (std_k + STD_EPSILON)).view(-1, f)  # (N, F)
        summed = (z * weights.unsqueeze(0)).nansum(dim=1)
        summed[unscorable] = float("nan")
        std = nanstd(summed).expand_as(summed) if n > 1 else torch.zeros_like(summed)
        advantages = (summed - torch.nanmean(summed)) / (std + STD_EPSILON)

    zero_std = torch.isclose(std, torch.zeros_like(std))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    return AdvantageResult(
        advantages=advantages.to(device=device, dtype=dtype),
        weighted_rewards=weighted.to(device=device, dtype=dtype),
        zero_std=zero_std.to(device),
        unscorable=unscorable.to(device),
    )


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    reward_weights: torch.Tensor | Sequence[float] | None = None,
    scale_rewards: ScaleRewards | bool = "group",
    multi_objective_aggregation: Aggregation = "sum_then_normalize",
) -> torch.Tensor:
    """``(N,)`` group-relative advantages; see :func:`compute_advantages_with_stats`.

    >>> compute_advantages(torch.tensor([[1.0], [0.0]]), num_generations=2)
    tensor([ 0.7070, -0.7070])
    """
    return compute_advantages_with_stats(
        rewards, num_generations, reward_weights, scale_rewards, multi_objective_aggregation
    ).advantages


def reward_metrics(
    rewards: torch.Tensor, names: Sequence[str], result: AdvantageResult
) -> dict[str, float]:
    """Generation-side reward metrics of spec §4.1, over the global batch.

    Args:
        rewards: ``(N, F)`` the same reward matrix given to the advantage computation.
        names: ``F`` reward-function names, used in ``rewards/<name>/mean`` and ``.../std``.
        result: The :class:`AdvantageResult` computed from ``rewards``.

    Returns:
        ``rewards/<name>/mean`` (nanmean) and ``rewards/<name>/std`` (unbiased nanstd) per
        function, ``reward`` and ``reward_std`` of the weighted sum (unscorable rows excluded),
        and ``frac_reward_zero_std``. A value with nothing to average is NaN.

    >>> r = torch.tensor([[1.0], [3.0]])
    >>> m = reward_metrics(r, ["acc"], compute_advantages_with_stats(r, 2))
    >>> m["rewards/acc/mean"], m["reward"], m["frac_reward_zero_std"]
    (2.0, 2.0, 0.0)
    """
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(1)
    if len(names) != rewards.shape[1]:
        raise ValueError(f"Got {len(names)} reward names for {rewards.shape[1]} reward columns.")
    rewards = _float64(rewards)  # a std of large rewards overflows float32
    weighted = _float64(result.weighted_rewards)
    metrics: dict[str, float] = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = float(torch.nanmean(rewards[:, i]))
        metrics[f"rewards/{name}/std"] = float(nanstd(rewards[:, i]))
    metrics["reward"] = float(torch.nanmean(weighted))
    metrics["reward_std"] = float(nanstd(weighted))
    metrics["frac_reward_zero_std"] = (
        float(result.zero_std.float().mean()) if result.zero_std.numel() else math.nan
    )
    return metrics

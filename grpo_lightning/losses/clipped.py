"""The PPO-style clipped family: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo`` (spec §3.3).

They share ``L = −min(c1·A, clamp(c1, 1−ε_lo, 1+ε_hi)·A)`` (with ``c1`` optionally capped at
``delta``) and the clip-ratio metrics, and differ only in how ``L`` is aggregated (spec §3.9).
"""

from __future__ import annotations

from typing import Literal

import torch

from grpo_lightning.losses.base import PolicyLoss, check_number
from grpo_lightning.losses.metrics import mean_metric, sequence_extreme_metric
from grpo_lightning.losses.normalizers import (
    fixed_length_mean,
    global_token_mean,
    sequence_mean,
    sequence_sum_mean,
    token_mean,
)
from grpo_lightning.losses.records import LossInputs, LossState, TokenLoss


class ClippedPolicyLoss(PolicyLoss):
    """Clipped surrogate shared by the grpo-like losses; subclasses choose the aggregation.

    Metrics: ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``
    (token means), ``clip_ratio/low_min`` and ``clip_ratio/high_max`` (extremes over sequences
    of the per-sequence clipped fraction). They use the ratio after the ``delta`` cap, as TRL does.
    """

    def per_token_loss(self, state: LossState) -> TokenLoss:
        ratio, advantages = state.ratio, state.advantages  # (B, T)|(B, 1), (B, 1)
        eps_lo, eps_hi = self.epsilon_low, self.epsilon_high_value
        clipped = torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi)
        if self.delta is not None:
            ratio = torch.clamp(ratio, max=self.delta)
        values = -torch.min(ratio * advantages, clipped * advantages)

        with torch.no_grad():
            low = ((ratio < 1 - eps_lo) & (advantages < 0)).float()
            high = ((ratio > 1 + eps_hi) & (advantages > 0)).float()
            region = torch.maximum(low, high)
            per_sequence = self.per_sequence(low)
            metrics = {
                "clip_ratio/low_mean": mean_metric(low, state.mask, per_sequence),
                "clip_ratio/high_mean": mean_metric(high, state.mask, per_sequence),
                "clip_ratio/region_mean": mean_metric(region, state.mask, per_sequence),
                "clip_ratio/low_min": sequence_extreme_metric(low, state.mask, "min", per_sequence),
                "clip_ratio/high_max": sequence_extreme_metric(high, state.mask, "max", per_sequence),
            }
        return TokenLoss(values, metrics)


class GRPOLoss(ClippedPolicyLoss):
    """GRPO: clipped surrogate, mean over each sequence's tokens, then over sequences.

    Returned loss: ``mean_i [Σ_t L m / max(Σ_t m, 1)] / GA``. With
    ``importance_sampling_level="sequence"`` this is GSPO.

    Args:
        epsilon: Lower clipping range ``ε_lo``.
        epsilon_high: Upper clipping range ``ε_hi``; ``None`` means ``epsilon``.
        delta: Cap on the unclipped ratio (two-sided clipping, > 1); ``None`` disables.
        beta: KL penalty coefficient; 0 disables the reference model.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        use_bias_correction_kl: Multiply the KL term by the importance ratio.
        off_policy_mask_threshold: Off-policy sequence-mask threshold; ``None`` disables.
    """

    name = "grpo"

    def normalize(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        return sequence_mean(per_token_loss, mask, inputs.batch_rows)


BNPO_NORMALIZERS = ("step", "micro_batch")


class BNPOLoss(ClippedPolicyLoss):
    """BNPO: clipped surrogate averaged over the active tokens of a batch.

    Returned loss, by ``normalizer``:

    * ``"step"`` (default): ``Σ L m / (max(N, 1) / P)``, not divided by ``GA``, with ``N`` =
      ``num_items_in_batch`` (active tokens of everything one optimizer step consumes, all
      ranks): the token mean over the optimizer step, so the step's gradient is the same however
      the batch is split into accumulation steps and ranks. This is dapo's normaliser. When ``N``
      is not given (``None``) it falls back to ``"micro_batch"``, TRL's formula.
    * ``"micro_batch"``: ``Σ L m / max(Σ m, 1) / GA`` over the local micro-batch's tokens, as
      TRL 1.16. The step's gradient is then a mean of per-micro-batch token means (on each
      rank, then averaged over ranks), which changes when the split changes (docs/losses.md,
      deviation 11).

    Both equal TRL's on one process with one micro-batch per optimizer step. The ``policy_loss``
    metric is the loss before the ``/GA`` (``"step"``: ``GA`` times the returned loss).

    Args:
        epsilon: Lower clipping range ``ε_lo``.
        epsilon_high: Upper clipping range ``ε_hi``; ``None`` means ``epsilon``.
        delta: Cap on the unclipped ratio (two-sided clipping, > 1); ``None`` disables.
        beta: KL penalty coefficient; 0 disables the reference model.
        importance_sampling_level: ``"token"`` or ``"sequence"``.
        use_bias_correction_kl: Multiply the KL term by the importance ratio.
        off_policy_mask_threshold: Off-policy sequence-mask threshold; ``None`` disables.
        normalizer: ``"step"`` (tokens of the optimizer step, all ranks: layout-invariant) or
            ``"micro_batch"`` (tokens of the local micro-batch: TRL 1.16's bnpo).
    """

    name = "bnpo"

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        beta: float = 0.0,
        importance_sampling_level: str = "token",
        use_bias_correction_kl: bool = True,
        off_policy_mask_threshold: float | None = None,
        normalizer: Literal["step", "micro_batch"] = "step",
    ) -> None:
        super().__init__(
            epsilon, epsilon_high, delta, beta, importance_sampling_level, use_bias_correction_kl,
            off_policy_mask_threshold,
        )
        if normalizer not in BNPO_NORMALIZERS:
            raise ValueError(
                f"normalizer={normalizer!r} is not valid for the 'bnpo' loss. Choose one of "
                f"{list(BNPO_NORMALIZERS)}: 'step' (tokens of the optimizer step on all ranks) or "
                "'micro_batch' (tokens of the local micro-batch, TRL 1.16)."
            )
        self.normalizer = normalizer

    def aggregate(
        self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.normalizer == "micro_batch" or inputs.num_items_in_batch is None:
            return super().aggregate(per_token_loss, mask, inputs)
        loss = global_token_mean(per_token_loss, mask, inputs.num_items_in_batch, inputs.num_processes)
        return loss, loss * inputs.gradient_accumulation_steps

    def normalize(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        return token_mean(per_token_loss, mask, inputs.batch_loss_tokens)


class DrGRPOLoss(ClippedPolicyLoss):
    """Dr. GRPO: clipped surrogate over a constant normaliser (no length bias).

    Returned loss: ``Σ L m / (B · max_completion_length) / GA``.

    Args:
        epsilon: Lower clipping range ``ε_lo``.
        epsilon_high: Upper clipping range ``ε_hi``; ``None`` means ``epsilon``.
        delta: Cap on the unclipped ratio (two-sided clipping, > 1); ``None`` disables.
        beta: KL penalty coefficient; 0 disables the reference model.
        importance_sampling_level: ``"token"`` or ``"sequence"``.
        use_bias_correction_kl: Multiply the KL term by the importance ratio.
        off_policy_mask_threshold: Off-policy sequence-mask threshold; ``None`` disables.
        max_completion_length: The normaliser constant; ``None`` uses the
            ``max_completion_length`` given with each call (the generation setting).
    """

    name = "dr_grpo"

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        beta: float = 0.0,
        importance_sampling_level: str = "token",
        use_bias_correction_kl: bool = True,
        off_policy_mask_threshold: float | None = None,
        max_completion_length: int | None = None,
    ) -> None:
        super().__init__(
            epsilon, epsilon_high, delta, beta, importance_sampling_level, use_bias_correction_kl,
            off_policy_mask_threshold,
        )
        if max_completion_length is not None:
            check_number("max_completion_length", max_completion_length, minimum=1)
        self.max_completion_length = max_completion_length

    def normalize(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        length = self.max_completion_length or inputs.max_completion_length
        if length is None:
            raise ValueError(
                "The 'dr_grpo' loss divides by max_completion_length, but none was given: set "
                "max_completion_length on the loss or pass it with the call."
            )
        if length < 1:
            raise ValueError(f"max_completion_length={length}: it must be at least 1.")
        return fixed_length_mean(per_token_loss, mask, length, inputs.batch_rows)


class DAPOLoss(ClippedPolicyLoss):
    """DAPO (TRL's default): clipped surrogate averaged over the optimizer step's tokens.

    Returned loss: ``Σ L m / (max(N, 1) / P)`` with ``N`` = ``num_items_in_batch`` (active tokens
    of everything one optimizer step consumes, all ranks); not divided by ``GA``. When ``N`` is not
    given, the micro-batch's own token count is used.

    Args:
        epsilon: Lower clipping range ``ε_lo``.
        epsilon_high: Upper clipping range ``ε_hi``; ``None`` means ``epsilon`` (DAPO uses 0.28).
        delta: Cap on the unclipped ratio (two-sided clipping, > 1); ``None`` disables.
        beta: KL penalty coefficient; 0 disables the reference model.
        importance_sampling_level: ``"token"`` or ``"sequence"``.
        use_bias_correction_kl: Multiply the KL term by the importance ratio.
        off_policy_mask_threshold: Off-policy sequence-mask threshold; ``None`` disables.
    """

    name = "dapo"
    divides_by_accumulation = False

    def normalize(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        return global_token_mean(
            per_token_loss, mask, inputs.num_items_in_batch, inputs.num_processes, inputs.batch_loss_tokens
        )


class LUSPOLoss(ClippedPolicyLoss):
    """LUSPO: clipped surrogate weighted by sequence length (meant for sequence-level ratios).

    Returned loss (TRL 1.16): ``mean_i [Σ_t L m] / GA``; at sequence level
    ``(1/B) Σ_i L_i·|o_i| / GA``.

    Args:
        epsilon: Lower clipping range ``ε_lo``.
        epsilon_high: Upper clipping range ``ε_hi``; ``None`` means ``epsilon``.
        delta: Cap on the unclipped ratio (two-sided clipping, > 1); ``None`` disables.
        beta: KL penalty coefficient; 0 disables the reference model.
        importance_sampling_level: Should be ``"sequence"`` (a warning otherwise).
        use_bias_correction_kl: Multiply the KL term by the importance ratio.
        off_policy_mask_threshold: Off-policy sequence-mask threshold; ``None`` disables.
    """

    name = "luspo"

    def normalize(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        return sequence_sum_mean(per_token_loss, mask, inputs.batch_rows)

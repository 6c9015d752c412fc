"""The shared GRPO policy-loss pipeline and its typed records (spec §3.1).

Every loss type runs the same steps in TRL's order; a subclass supplies only the per-token loss
(step 4) and the aggregation (step 9):

1. off-policy sequence mask (OPSM) from the *detached* current log-probs;
2. log-ratio ``Δ = ℓ − ℓ_old`` and importance weight ``c1 = exp(Δ)`` (token) or
   ``exp(masked mean Δ)`` (sequence);
3. k3 reference KL, times the un-clamped ``c1`` when ``use_bias_correction_kl``;
4. per-token loss ``L`` (subclass);
5. ``L ← L · OPSM``; 6. ``L ← L · E`` (top-entropy mask, if given);
7. ``L ← L · ρ`` (sampler IS weight, not for vespo); 8. ``L ← L + β·KL``;
9. aggregation (subclass) and, for the grpo-like families, division by the accumulation steps;
10. entropy bonus ``− coef · [Σ H m' / max(Σ m', 1)] / GA`` with ``m' = m · E``.

Layer L1: torch, the standard library, ``grpo_lightning.types`` and ``grpo_lightning.algo``.
"""

from __future__ import annotations

import math
import warnings
from typing import ClassVar

import torch

from grpo_lightning.losses.metrics import mean_metric
from grpo_lightning.losses.records import LossInputs, LossOutput, LossState, TokenLoss
from grpo_lightning.types import MetricValue

__all__ = [
    "LossInputs", "LossOutput", "LossState", "PolicyLoss", "TokenLoss", "check_number", "off_policy_mask",
]

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# Loss types that sum per-token terms, so sequence-level ratios weight a sequence by its length.
_LENGTH_WEIGHTED_AT_SEQUENCE_LEVEL = ("bnpo", "dr_grpo", "dapo", "cispo")


class PolicyLoss:
    """Base class of the GRPO loss family: TRL's ``_compute_loss`` pipeline (spec §3).

    Subclasses set ``name`` (the registry key) and implement :meth:`per_token_loss` and
    :meth:`normalize`. Calling the object with :class:`LossInputs` returns :class:`LossOutput`.

    Args:
        epsilon: Lower clipping range ``ε_lo``: the ratio is clipped below at ``1 − epsilon``
            (clipped family only).
        epsilon_high: Upper clipping range ``ε_hi`` (``1 + epsilon_high``); ``None`` means the
            class's ``default_epsilon_high``, which is ``epsilon`` unless a subclass sets one. For
            ``cispo`` it is the cap on the ratio itself and ``None`` means 5.0 (ScaleRL).
        delta: Two-sided clipping (INTELLECT-2): caps the unclipped ratio at ``delta`` (> 1);
            ``None`` disables. Clipped family only.
        beta: Coefficient of the k3 KL penalty to the reference model; 0 disables it and no
            reference model is needed.
        importance_sampling_level: ``"token"`` (one ratio per token) or ``"sequence"`` (GSPO: the
            exponentiated masked mean of the token log-ratios, one per sequence).
        use_bias_correction_kl: Multiply the per-token KL by the importance ratio ``c1``.
        off_policy_mask_threshold: Off-policy sequence masking (DeepSeek-V3.2): drop sequences with
            negative advantage whose mean ``ℓ_sampler − ℓ`` exceeds this value. ``None`` disables.
    """

    name: ClassVar[str] = ""
    # vespo folds the sampler IS weight into its sequence weight instead of multiplying L by it.
    multiplies_is_weight: ClassVar[bool] = True
    # grpo-like families divide by the accumulation steps; dapo/cispo/vespo use a global count.
    divides_by_accumulation: ClassVar[bool] = True
    # ε_hi when epsilon_high is None; None here means "epsilon" (cispo overrides it with 5.0).
    default_epsilon_high: ClassVar[float | None] = None

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        beta: float = 0.0,
        importance_sampling_level: str = "token",
        use_bias_correction_kl: bool = True,
        off_policy_mask_threshold: float | None = None,
    ) -> None:
        if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level={importance_sampling_level!r} is not valid. Choose one of "
                f"{list(IMPORTANCE_SAMPLING_LEVELS)}."
            )
        check_number("epsilon", epsilon, minimum=0.0)
        if epsilon_high is not None:
            check_number("epsilon_high", epsilon_high, minimum=0.0)
        if delta is not None:
            check_number("delta", delta)
            if delta <= 1.0:
                raise ValueError(
                    f"delta={delta}: the two-sided clipping cap must be > 1 (INTELLECT-2 uses 4); "
                    "use None to disable it."
                )
        check_number("beta", beta, minimum=0.0)
        if off_policy_mask_threshold is not None:
            check_number("off_policy_mask_threshold", off_policy_mask_threshold)
        self.epsilon = float(epsilon)
        self.epsilon_high = None if epsilon_high is None else float(epsilon_high)
        self.delta = None if delta is None else float(delta)
        self.beta = float(beta)
        self.importance_sampling_level = importance_sampling_level
        self.use_bias_correction_kl = bool(use_bias_correction_kl)
        self.off_policy_mask_threshold = (
            None if off_policy_mask_threshold is None else float(off_policy_mask_threshold)
        )
        self._warn_about_level()

    @property
    def epsilon_low(self) -> float:
        """``ε_lo`` (= ``epsilon``)."""
        return self.epsilon

    @property
    def epsilon_high_value(self) -> float:
        """``ε_hi``: ``epsilon_high``; when that is ``None``, the class's ``default_epsilon_high``,
        or ``epsilon`` when the class sets none."""
        if self.epsilon_high is not None:
            return self.epsilon_high
        return self.epsilon if self.default_epsilon_high is None else self.default_epsilon_high

    def per_sequence(self, values: torch.Tensor) -> bool:
        """Whether ``values`` (derived from the ratio) holds one value per sequence: a
        sequence-level ratio that nothing widened to ``(B, T)``. A token-level ``(B, 1)`` tensor
        (a micro-batch trimmed to width 1) is per token."""
        return self.importance_sampling_level == "sequence" and values.shape[-1] == 1

    def _warn_about_level(self) -> None:
        level = self.importance_sampling_level
        if self.name == "luspo" and level != "sequence":
            warnings.warn(
                "When using the 'luspo' loss, importance_sampling_level should be 'sequence' to mirror the "
                "paper's setup.",
                stacklevel=3,
            )
        if self.name == "vespo" and level != "token":
            warnings.warn(
                "VESPO computes sequence-level importance weights internally; importance_sampling_level "
                "should be 'token' (the default).",
                stacklevel=3,
            )
        if level == "sequence" and self.name in _LENGTH_WEIGHTED_AT_SEQUENCE_LEVEL:
            warnings.warn(
                f"With importance_sampling_level='sequence' the {self.name!r} loss sums per-token "
                "contributions, which weights each sequence by its completion length instead of optimizing "
                "the per-sequence objective. For the GSPO setup use the 'grpo' loss.",
                stacklevel=3,
            )

    # ---- subclass hooks -------------------------------------------------------------------------
    def per_token_loss(self, state: LossState) -> TokenLoss:
        """Step 4: the loss-type-specific per-token loss ``L`` and its own metrics."""
        raise NotImplementedError

    def normalize(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        """Step 9: aggregate ``L`` (``(B, T)`` or ``(B, 1)``) into a scalar, before any GA division."""
        raise NotImplementedError

    def aggregate(
        self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 9: ``(loss, policy_loss metric)``: :meth:`normalize`, then for the grpo-like
        families the division by the accumulation steps (the metric is taken before it)."""
        policy_loss = self.normalize(per_token_loss, mask, inputs)
        if not self.divides_by_accumulation:
            return policy_loss, policy_loss
        return policy_loss / inputs.gradient_accumulation_steps, policy_loss

    # ---- the pipeline ---------------------------------------------------------------------------
    def __call__(self, inputs: LossInputs) -> LossOutput:
        """Compute the micro-step loss and metrics (spec §3.1 order of operations)."""
        logps = inputs.logps  # (B, T)
        if logps.dim() != 2:
            raise ValueError(f"logps must have shape (B, T); got {tuple(logps.shape)}.")
        mask = inputs.mask.to(logps.dtype)  # (B, T)
        if mask.shape != logps.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} does not match logps {tuple(logps.shape)}.")
        advantages = inputs.advantages.to(logps.dtype)
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)  # (B, 1)
        old_logps = logps.detach() if inputs.old_logps is None else inputs.old_logps
        metrics: dict[str, MetricValue] = {}

        # 1. OPSM from the detached current log-probs.
        keep = None
        if self.off_policy_mask_threshold is not None:
            reference = old_logps if inputs.sampling_logps is None else inputs.sampling_logps
            keep = off_policy_mask(advantages, logps, reference, mask, self.off_policy_mask_threshold)

        # 2. Importance weight.
        log_ratio = logps - old_logps  # (B, T)
        if self.importance_sampling_level == "token":
            log_weights = log_ratio
        else:  # sequence: masked mean of the token log-ratios
            log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        ratio = torch.exp(log_weights)  # (B, T) or (B, 1)

        # 3. Reference KL (k3), bias-corrected with the un-clamped ratio.
        kl = None
        if self.beta != 0.0:
            if inputs.ref_logps is None:
                raise ValueError(f"beta={self.beta} needs ref_logps (reference-model log-probs).")
            diff = inputs.ref_logps - logps
            kl = torch.exp(diff) - diff - 1  # (B, T)
            if self.use_bias_correction_kl:
                kl = kl * ratio

        # 4. Per-token loss.
        state = LossState(logps, advantages, mask, log_ratio, ratio, inputs.sampling_is_weights)
        token_loss = self.per_token_loss(state)
        per_token = token_loss.values
        metrics.update(token_loss.metrics)

        # 5-8. OPSM, top-entropy mask, sampler IS weight, KL (never masked nor weighted).
        if keep is not None:
            per_token = per_token * keep
        bonus_mask = mask
        if inputs.entropy_mask is not None:
            entropy_mask = inputs.entropy_mask.to(logps.dtype)
            per_token = per_token * entropy_mask
            bonus_mask = mask * entropy_mask
        if inputs.sampling_is_weights is not None and self.multiplies_is_weight:
            per_token = per_token * inputs.sampling_is_weights
        if kl is not None:
            per_token = per_token + self.beta * kl

        # 9. Aggregate.
        loss, policy_loss = self.aggregate(per_token, mask, inputs)
        accumulation = inputs.gradient_accumulation_steps

        # 10. Entropy bonus: per-token mean entropy of the micro-batch for every loss type.
        if inputs.entropy_coef != 0.0:
            if inputs.entropies is None:
                raise ValueError(f"entropy_coef={inputs.entropy_coef} needs per-token entropies.")
            mean_entropy = (inputs.entropies * bonus_mask).sum() / _bonus_tokens(bonus_mask, inputs).clamp(min=1.0)
            loss = loss - inputs.entropy_coef * mean_entropy / accumulation
            # A NaN value counts 0 (TRL takes a nanmean over ranks); no host sync here. A part of a
            # micro-batch counts for its share of the rows, so that the parts add up to one value.
            detached = policy_loss.detach().float()
            valid = ~torch.isnan(detached)
            share = 1.0 if inputs.totals is None else logps.shape[0] / inputs.totals.rows
            metrics["policy_loss"] = MetricValue(torch.where(valid, detached, 0.0), valid.float() * share)

        if kl is not None:
            metrics["kl"] = mean_metric(kl, mask)
        if inputs.entropies is not None:
            metrics["entropy"] = mean_metric(inputs.entropies, mask)
        return LossOutput(loss=loss, metrics=metrics)

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({knobs})"


def _bonus_tokens(bonus_mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """The entropy bonus normaliser: ``Σ m'`` of the whole micro-batch."""
    if inputs.totals is None:
        return bonus_mask.sum()
    if inputs.totals.bonus_tokens is not None:
        return inputs.totals.bonus_tokens.to(bonus_mask)
    if inputs.entropy_mask is not None:
        raise ValueError(
            "LossInputs.totals.bonus_tokens is needed with an entropy_mask: build the totals with "
            "MicroBatchTotals.of(mask, entropy_mask) over the whole micro-batch."
        )
    return inputs.totals.loss_tokens.to(bonus_mask)


def off_policy_mask(
    advantages: torch.Tensor,
    logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """OPSM keep-mask ``(B, 1)``: keep when ``A ≥ 0`` or masked mean ``(ℓ_s − ℓ) ≤ threshold``.

    Tokens the sampler could not score (NaN) contribute 0 to the mean, as in TRL.
    """
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)  # (B, T)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def check_number(name: str, value: float, minimum: float | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: expected a finite number.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value}: it must be >= {minimum}.")

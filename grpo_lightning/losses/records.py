"""Typed records of the loss pipeline: what a micro-step's loss takes and returns.

Layer L1: torch, the standard library and ``grpo_lightning.types`` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo_lightning.types import MetricValue


@dataclass(frozen=True)
class MicroBatchTotals:
    """Counts of a whole micro-batch, for a loss computed on one part of it.

    A token-budget training pass scores a micro-batch in parts (one forward+backward each); the
    per-micro-batch normalisers (rows for grpo/sapo/luspo/dr_grpo, loss tokens for bnpo's
    ``micro_batch`` normaliser and the entropy bonus) then use these counts instead of the part's, so that the parts' losses, and
    their gradients, sum exactly to the micro-batch's.

    Attributes:
        rows: ``B`` of the whole micro-batch.
        loss_tokens: ``Σ mask`` over the whole micro-batch, ``()`` float.
        bonus_tokens: ``Σ mask·entropy_mask`` over the whole micro-batch (the entropy bonus
            normaliser); ``None`` means ``loss_tokens`` (no top-entropy mask).

    >>> totals = MicroBatchTotals.of(torch.tensor([[1, 1, 0], [1, 0, 0]]))
    >>> totals.rows, float(totals.loss_tokens)
    (2, 3.0)
    """

    rows: int
    loss_tokens: torch.Tensor
    bonus_tokens: torch.Tensor | None = None

    @classmethod
    def of(cls, mask: torch.Tensor, entropy_mask: torch.Tensor | None = None) -> "MicroBatchTotals":
        """The counts of a micro-batch's ``(B, T)`` loss mask (and top-entropy mask)."""
        mask = mask.float()
        bonus = None if entropy_mask is None else (mask * entropy_mask.float()).sum()
        return cls(rows=mask.shape[0], loss_tokens=mask.sum(), bonus_tokens=bonus)


@dataclass
class LossInputs:
    """Everything one micro-step's loss needs, as plain tensors.

    Attributes:
        logps: ``(B, T)`` log-probs of the sampled tokens under the current policy (with grad).
        old_logps: ``(B, T)`` log-probs at generation time; ``None`` means on-policy
            (``logps.detach()``), as TRL does when it skips the old-logprob pass.
        advantages: ``(B,)`` per-sequence advantages (``(B, T)`` per-token also accepted).
        mask: ``(B, T)`` 1 for loss tokens (completion mask times tool mask).
        ref_logps: ``(B, T)`` reference-model log-probs; required when ``beta != 0``.
        sampling_logps: ``(B, T)`` log-probs reported by the sampler (vLLM); the OPSM reference
            (``old_logps`` when absent).
        sampling_is_weights: ``(B, T)`` or ``(B, 1)`` sampler importance-sampling correction
            ``ρ``; multiplies the policy term (folded into φ for vespo). ``None`` disables it.
        entropies: ``(B, T)`` per-token entropies; needed for the entropy bonus and the
            ``entropy`` metric.
        num_items_in_batch: Active-token count, all ranks, of the batch one optimizer step
            consumes: the dapo/cispo/vespo/bnpo normaliser. ``None`` uses this micro-batch's count.
        max_completion_length: The dr_grpo normaliser constant when the loss object has none.
        num_processes: ``P``, data-parallel ranks (for the dapo/cispo/vespo normaliser).
        gradient_accumulation_steps: ``GA_eff``: micro-steps per optimizer step (1 in eval).
        entropy_coef: Coefficient of the entropy bonus; 0 disables it.
        entropy_mask: ``(B, T)`` top-entropy token selection (``top_entropy_quantile < 1``, see
            :func:`~grpo_lightning.losses.entropy_mask.top_entropy_mask`): multiplies the policy
            term (not the KL) and restricts the entropy bonus; the normalisers are unchanged, as
            in TRL. ``None`` disables it.
        totals: Counts of the whole micro-batch when these inputs are one part of it (see
            :class:`MicroBatchTotals`); ``None``: the rows given are the whole micro-batch.
    """

    logps: torch.Tensor
    old_logps: torch.Tensor | None
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logps: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None
    sampling_is_weights: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    num_items_in_batch: torch.Tensor | float | None = None
    max_completion_length: int | None = None
    num_processes: int = 1
    gradient_accumulation_steps: int | float = 1
    entropy_coef: float = 0.0
    entropy_mask: torch.Tensor | None = None
    totals: MicroBatchTotals | None = None

    @property
    def batch_rows(self) -> int | None:
        """Rows of the whole micro-batch, or ``None`` for the rows given."""
        return None if self.totals is None else self.totals.rows

    @property
    def batch_loss_tokens(self) -> torch.Tensor | None:
        """Loss tokens of the whole micro-batch, or ``None`` for the tokens given."""
        return None if self.totals is None else self.totals.loss_tokens


@dataclass
class LossOutput:
    """The micro-step loss (already scaled as TRL returns it to backward) and its metrics.

    Attributes:
        loss: Scalar tensor to backpropagate.
        metrics: Spec §4.2 metrics as local sums/counts (or extremes) for an exact reduction
            across ranks and micro-steps.
    """

    loss: torch.Tensor
    metrics: dict[str, MetricValue] = field(default_factory=dict)


@dataclass
class LossState:
    """Intermediate tensors of the pipeline handed to a subclass's per-token loss.

    Attributes:
        logps: ``(B, T)`` current log-probs (with grad).
        advantages: ``(B, 1)`` (or ``(B, T)``) advantages.
        mask: ``(B, T)`` float loss mask.
        log_ratio: ``(B, T)`` ``ℓ − ℓ_old`` (with grad).
        ratio: ``c1``: ``(B, T)`` at token level, ``(B, 1)`` at sequence level (with grad).
        sampling_is_weights: The sampler IS weight ``ρ`` or ``None``.
    """

    logps: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    sampling_is_weights: torch.Tensor | None


@dataclass
class TokenLoss:
    """A subclass's per-token loss and the metrics only it can compute.

    Attributes:
        values: ``(B, T)`` or ``(B, 1)`` per-token loss ``L``.
        metrics: Loss-specific metrics (clip ratios, ``vespo/phi_seq_mean``, ...).
    """

    values: torch.Tensor
    metrics: dict[str, MetricValue] = field(default_factory=dict)

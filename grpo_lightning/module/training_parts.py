"""Token-budget training passes: a micro-batch scored in parts sized by tokens, not rows.

With ``forward.train_token_budget`` set, :meth:`GRPOModule.training_step` runs one forward and
backward per part, so the activations held at once follow the budget rather than the
micro-batch's row count (long completions no longer force a smaller ``per_device_train_batch_size``
that would change the loss). Every per-micro-batch normaliser reads the whole micro-batch's
counts (:class:`~grpo_lightning.losses.MicroBatchTotals`), so the summed gradient, the loss and the
metrics are those of the one-pass step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from grpo_lightning.algo.shared_prefix import budget_groups
from grpo_lightning.losses import LossOutput, MicroBatchTotals, merge_metrics
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.types import MetricValue, RolloutBatch


@dataclass
class StepLoss:
    """What one ``training_step`` produced.

    Attributes:
        loss: The tensor handed back to Lightning for backward (the last part's loss when the
            micro-batch was trained in parts).
        metrics: Loss-side metrics of the whole micro-batch (sums and counts).
        value: The micro-step's loss in TRL's scale (all parts), for logging: a detached tensor,
            read when the optimizer step closes (not between the forward and the backward).
    """

    loss: torch.Tensor
    metrics: dict[str, MetricValue]
    value: torch.Tensor

    @classmethod
    def of(cls, out: LossOutput) -> "StepLoss":
        return cls(out.loss, out.metrics, out.loss.detach())


def training_parts(batch: RolloutBatch, options: ForwardOptions) -> list[RolloutBatch]:
    """The parts ``batch`` is trained in: itself, or groups of rows within the token budget.

    Rows are grouped longest first (similar lengths share a part, so little padding), sized by
    real tokens when the forward is padding-free and by ``rows × padded width`` otherwise; a row
    longer than the budget is a part of its own. With ``share_prompt_prefix`` the samples of a
    prompt stay in the same part where they fit, so they still share its forward. Each part is
    trimmed of the padding it does not need.
    """
    budget = options.train_token_budget
    if budget is None:
        return [batch]
    groups = budget_groups(
        batch.prompt_ids, batch.prompt_mask, batch.completion_mask, budget,
        packed=options.padding_free, share_prompts=options.share_prompt_prefix,
    )
    if len(groups) == 1:
        return [batch]
    return [batch.select_rows(rows) for rows in groups]


class PartsBackward:
    """Trains the parts of one micro-batch inside a single Lightning ``training_step``.

    Two Lightning details, handled here once:

    * every part but the last is backpropagated inside the step (freeing its activations); the
      last part's loss goes back to Lightning, whose backward completes the micro-step and, under
      DDP, the gradient sync (``strategy.backward`` of earlier parts accumulates locally);
    * Lightning zeroes the gradients of a new accumulation window *after* that window's first
      ``training_step`` (right before its backward), which would erase the parts already
      backpropagated: the first step of a window zeroes them before its parts instead, and
      :meth:`skips_zero_grad` tells the module's ``optimizer_zero_grad`` to skip Lightning's call.
    """

    def __init__(self) -> None:
        self._zeroed_at: int | None = None

    def run(
        self,
        parts: list[RolloutBatch],
        loss_of: Callable[[RolloutBatch, MicroBatchTotals], LossOutput],
        totals: MicroBatchTotals,
        trainer: Any,
        batch_idx: int,
    ) -> StepLoss:
        """Forward+backward of each part but the last; the last part's loss is left for
        Lightning to backpropagate."""
        if batch_idx % trainer.accumulate_grad_batches == 0:
            for optimizer in trainer.optimizers:
                optimizer.zero_grad()
            self._zeroed_at = batch_idx
        outputs = []
        for index, part in enumerate(parts):
            out = loss_of(part, totals)
            if index < len(parts) - 1:
                trainer.strategy.backward(out.loss, None)
            outputs.append(out)
        value = torch.stack([o.loss.detach() for o in outputs]).sum()
        return StepLoss(outputs[-1].loss, merge_metrics([o.metrics for o in outputs]), value)

    def skips_zero_grad(self, batch_idx: int) -> bool:
        """True (once) when this step's gradients were already zeroed before its parts."""
        if self._zeroed_at == batch_idx:
            self._zeroed_at = None
            return True
        return False

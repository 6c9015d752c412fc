"""Token-budget training passes: a micro-batch scored in parts sized by tokens, not rows.

With ``forward.train_token_budget`` set, :meth:`GRPOModule.training_step` runs one forward and
backward per part, so the activations held at once follow the budget rather than the
micro-batch's row count (long completions no longer force a smaller ``per_device_train_batch_size``
that would change the loss). Every per-micro-batch normaliser reads the whole micro-batch's
counts (:class:`~grpo_lightning.losses.MicroBatchTotals`), so the summed gradient, the loss and the
metrics are those of the one-pass step.
"""

from __future__ import annotations

from grpo_lightning.algo.shared_prefix import budget_groups
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.types import RolloutBatch


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

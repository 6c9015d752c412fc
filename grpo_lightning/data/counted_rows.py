"""Rows that are generated but do not count: evaluation prompts repeated to keep ranks in step.

Every rank must run the same validation steps with the same shapes (collectives), so the last
evaluation step repeats prompts from the start of the set (``EvalPlan``). Such rows are generated
like the others but are never scored, and they carry no weight in metrics, advantages or the loss.
No lightning here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch

from grpo_lightning.rewards.runner import RewardRunner, RewardScores
from grpo_lightning.types import RolloutBatch


def score_counted_rows(
    runner: RewardRunner,
    counts: Sequence[bool] | None,
    *,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: dict[str, Sequence[Any]],
    trainer_state: Any = None,
    environments: Sequence[Any] | None = None,
) -> RewardScores:
    """Score only the rows that count; the others get NaN rewards ("not applicable").

    Reward functions never see the rows that do not count, so what they push through
    ``log_metric``/``log_extra`` covers the counted rows alone.

    Args:
        runner: The reward runner.
        counts: Per row, whether it counts; ``None`` = every row counts.
        prompts, completions, completion_ids, columns, trainer_state, environments: As for
            :meth:`RewardRunner.score`, one entry per row (``environments``: agents only).

    Returns:
        The scores, with a ``(B, F)`` reward matrix covering every row.
    """
    keep = list(range(len(prompts))) if counts is None else [i for i, c in enumerate(counts) if c]
    if len(keep) == len(prompts):
        return runner.score(
            prompts=prompts, completions=completions, completion_ids=completion_ids, columns=columns,
            trainer_state=trainer_state, environments=environments,
        )
    rewards = torch.full((len(prompts), len(runner.funcs)), float("nan"), dtype=torch.float32)
    if not keep:
        return RewardScores(rewards, runner.names)

    def pick(values: Sequence[Any]) -> list[Any]:
        return [values[i] for i in keep]

    scores = runner.score(
        prompts=pick(prompts), completions=pick(completions), completion_ids=pick(completion_ids),
        columns={name: pick(values) for name, values in columns.items()}, trainer_state=trainer_state,
        environments=None if environments is None else pick(environments),
    )
    rewards[keep] = scores.rewards
    return replace(scores, rewards=rewards)


def exclude_rows(batch: RolloutBatch, rows: torch.Tensor) -> None:
    """Empty the loss mask of ``rows`` (``(B,)`` bool), in place: no loss, no token counts.

    Their advantages must already be 0. Losses normalised by the global token count (``dapo``,
    the default, ``cispo``, ``vespo``) then ignore them exactly; per-sequence means (``grpo``,
    ``sapo``, ``dr_grpo``) still count them as rows of zero loss in their row count.
    """
    batch.completion_mask[rows] = 0
    if batch.tool_mask is not None:
        batch.tool_mask[rows] = 0

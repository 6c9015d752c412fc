"""The training and evaluation prompt sets, loaded and checked against the reward functions when
the datamodule is built: before the model loads and before a logger creates a run."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from grpo_lightning.data.sources import load_prompt_dataset
from grpo_lightning.rewards.loading import RewardFunction
from grpo_lightning.rewards.signatures import check_reward_signatures


def load_prompt_sets(
    train_source: Mapping[str, Any],
    eval_sources: Mapping[str, Mapping[str, Any]],
    reward_funcs: Iterable[RewardFunction],
    extra_fields: Iterable[str] = (),
) -> tuple[Any, dict[str, Any]]:
    """Load every prompt set (prompts checked by :func:`load_prompt_dataset`) and check that each
    reward function can be called with each set's columns (its signature only, no call).

    Args:
        train_source: ``load_prompt_dataset`` arguments of ``data.dataset``.
        eval_sources: Per evaluation set name (``""`` for a single set), its arguments.
        reward_funcs: The resolved ``data.reward_funcs``.
        extra_fields: Per-completion fields the sampler adds to the reward columns.

    Returns:
        The training dataset and the evaluation datasets by name.

    Raises:
        FileNotFoundError, ValueError: A missing or unusable dataset, or a reward function that
            needs a column a set lacks.
    """
    funcs, extra = list(reward_funcs), list(extra_fields)
    train = load_prompt_dataset(**train_source)
    check_reward_signatures(funcs, train.column_names, f"data.dataset '{train_source['path_or_name']}'", extra)
    evals = {}
    for name, source in eval_sources.items():
        evals[name] = load_prompt_dataset(**source)
        label = "data.eval_dataset" + (f"[{name!r}]" if name else "") + f" '{source['path_or_name']}'"
        check_reward_signatures(funcs, evals[name].column_names, label, extra)
    return train, evals

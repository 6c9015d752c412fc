"""The data side's half of the sampler contract (DESIGN.md, "Contracts for scale").

Before a sampler generates, it must serve the policy version being trained; after, its rollouts
must be what the contract promises. Both checks live here so every caller (training and evaluation
batches, agents later) gets them, and a broken back-end fails on its first batch with a message
that names it instead of producing silently wrong training data.
"""

from __future__ import annotations

from typing import Any, Sequence

from grpo_lightning.samplers.base import Sampler
from grpo_lightning.types import GenerationParams, PolicyHandle, PromptInput, Rollout


def generate_checked(
    sampler: Sampler, handle: PolicyHandle, prompts: Sequence[PromptInput], num_generations: int,
    params: GenerationParams,
) -> list[Rollout]:
    """``sampler.generate`` after checking it serves the current policy, with its output checked."""
    name = type(sampler).__name__
    served, current = sampler.served_version, handle.policy_version
    if served != current:
        raise RuntimeError(
            f"{name} serves policy version {served} but the policy is at optimizer step {current}: its weights "
            "were not pushed. Samplers that keep their own weights are updated by the WeightSync callback "
            "(grpo_lightning.callbacks.WeightSync, added automatically by RolloutDataModule); check that it is "
            "not removed and that its push did not fail."
        )
    rollouts = sampler.generate(prompts, num_generations, params)
    expected = len(prompts) * num_generations
    if len(rollouts) != expected:
        raise RuntimeError(f"{name}.generate returned {len(rollouts)} rollouts for {len(prompts)} prompts x "
                           f"{num_generations} generations; expected {expected}.")
    for index, rollout in enumerate(rollouts):
        _check_rollout(name, sampler, index, rollout)
    return rollouts


def _check_rollout(name: str, sampler: Sampler, index: int, rollout: Rollout) -> None:
    n = len(rollout.completion_ids)
    logprobs = rollout.sampling_logprobs
    if sampler.provides_logprobs and logprobs is None:
        raise RuntimeError(f"{name} declares provides_logprobs but rollout {index} has no sampling_logprobs.")
    if logprobs is not None and len(logprobs) != n:
        raise RuntimeError(f"{name}: rollout {index} has {len(logprobs)} sampling_logprobs for {n} completion tokens.")
    if rollout.tool_mask is not None and len(rollout.tool_mask) != n:
        raise RuntimeError(f"{name}: rollout {index} has a tool_mask of {len(rollout.tool_mask)} for {n} tokens.")


def with_rollout_fields(columns: dict[str, list[Any]], rollouts: Sequence[Rollout]) -> dict[str, list[Any]]:
    """The reward-function columns: the dataset's, plus every ``Rollout.extra`` field (one value
    per completion; ``None`` where a rollout lacks it). A field named like a dataset column is an
    error: silently replacing the column would score against the wrong data."""
    names = sorted({key for rollout in rollouts for key in rollout.extra})
    clashes = [n for n in names if n in columns]
    if clashes:
        raise ValueError(
            f"Rollout.extra fields {clashes} have the names of dataset columns: rename them in the sampler/agent "
            "so reward functions get both."
        )
    return {**columns, **{n: [rollout.extra.get(n) for rollout in rollouts] for n in names}}

"""Evaluation batches: which prompts each validation step scores, on which rank."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset

from grpo_lightning.data.prompt_order import shuffle_seed


@dataclass(unsafe_hash=True)  # not frozen: see MicroStepRef
class EvalRef:
    """One validation step: a slice of an evaluation set, for this rank."""

    name: str  # "" for a single eval set, else the set's key
    step: int
    prompt_indices: tuple[int, ...]  # unique prompts of this rank, in dataset order
    # Per prompt slot: True when it repeats a prompt only so every rank has as many (the wrapped
    # end of the set with several ranks); such prompts are generated but count in no metric.
    repeats: tuple[bool, ...] = ()

    def rows(self, num_generations: int) -> tuple[list[int], list[bool]]:
        """The dataset row of every completion (each prompt ``num_generations`` times) and
        whether it counts.

        >>> EvalRef("", 2, (4, 0), (False, True)).rows(2)
        ([4, 4, 0, 0], [True, True, False, False])
        """
        repeats = self.repeats or (False,) * len(self.prompt_indices)
        row_ids = [i for i in self.prompt_indices for _ in range(num_generations)]
        counts = [not r for r in repeats for _ in range(num_generations)]
        return row_ids, counts


@dataclass(frozen=True)
class EvalPlan:
    """How an evaluation set is cut into validation steps.

    Every rank scores ``prompts_per_rank`` unique prompts x ``num_generations`` completions per
    step. With several ranks the last step wraps around to the start of the set so every rank
    has the same number of prompts and shapes (as ``DistributedSampler`` does); the wrapped
    prompts are marked by :meth:`repeats` and count in no metric, so each prompt counts once.
    """

    num_rows: int
    prompts_per_rank: int
    world_size: int = 1

    @property
    def num_steps(self) -> int:
        return math.ceil(self.num_rows / (self.prompts_per_rank * self.world_size))

    def indices(self, step: int, rank: int) -> tuple[int, ...]:
        """Unique prompt indices of ``rank`` at ``step``.

        >>> plan = EvalPlan(num_rows=5, prompts_per_rank=2, world_size=1)
        >>> [plan.indices(s, 0) for s in range(plan.num_steps)]
        [(0, 1), (2, 3), (4,)]
        >>> plan = EvalPlan(num_rows=5, prompts_per_rank=1, world_size=2)
        >>> [(plan.indices(s, 0), plan.indices(s, 1)) for s in range(plan.num_steps)]
        [((0,), (1,)), ((2,), (3,)), ((4,), (0,))]
        """
        per_step = self.prompts_per_rank * self.world_size
        start = step * per_step + rank * self.prompts_per_rank
        if self.world_size == 1:
            return tuple(range(start, min(start + self.prompts_per_rank, self.num_rows)))
        return tuple(i % self.num_rows for i in range(start, start + self.prompts_per_rank))

    def repeats(self, step: int, rank: int) -> tuple[bool, ...]:
        """Per prompt of :meth:`indices`: True when it wrapped around (a repeat that does not count).

        >>> plan = EvalPlan(num_rows=5, prompts_per_rank=1, world_size=2)
        >>> plan.repeats(2, 0), plan.repeats(2, 1)
        ((False,), (True,))
        """
        start = step * self.prompts_per_rank * self.world_size + rank * self.prompts_per_rank
        return tuple(start + j >= self.num_rows for j in range(len(self.indices(step, rank))))


class EvalStream(IterableDataset):
    """Yields the :class:`EvalRef` of every validation step of one evaluation set."""

    def __init__(self, name: str, plan: EvalPlan, rank: int) -> None:
        self.name, self.plan, self.rank = name, plan, rank

    def __iter__(self) -> Iterator[EvalRef]:
        for step in range(self.plan.num_steps):
            yield EvalRef(self.name, step, self.plan.indices(step, self.rank), self.plan.repeats(step, self.rank))

    def __len__(self) -> int:
        return self.plan.num_steps


@contextmanager
def isolated_rng(seed: int) -> Iterator[None]:
    """Run the block on its own RNG stream, seeded with ``seed``; the caller's stream (CPU and
    the current CUDA device) is as it was afterwards. Evaluation samples this way: it is
    reproducible, and training's stream is the same with or without it (and after a resume)."""
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


def eval_step_seed(order_seed: int, rank: int, global_step: int, set_index: int, eval_step: int) -> int:
    """The seed of one validation step's sampling (:func:`isolated_rng`): reproducible per (data
    seed, rank, optimizer step, evaluation set, step), apart from every training shuffle seed."""
    return shuffle_seed(order_seed, rank, global_step, 10_000 + 1_000 * set_index + eval_step)


def eval_sources(eval_dataset: str | dict[str, str] | None, dataset_config: str | None, eval_split: str,
                 prompt_column: str, prompt_template: str | None, per_device_eval_batch_size: int,
                 num_generations_eval: int) -> dict[str, dict[str, Any]]:
    """The evaluation sets by name (``""`` for a single one) as ``load_prompt_sets`` sources;
    checks that a validation step scores whole groups."""
    if eval_dataset:
        check_eval_sizes(per_device_eval_batch_size, num_generations_eval)
    sets = eval_dataset if isinstance(eval_dataset, dict) else ({"": eval_dataset} if eval_dataset else {})
    return {name: dict(path_or_name=source, name=dataset_config, split=eval_split, prompt_column=prompt_column,
                       prompt_template=prompt_template) for name, source in sets.items()}


def check_eval_sizes(per_device_eval_batch_size: int, num_generations_eval: int) -> None:
    """A validation step scores whole groups: a positive batch, a multiple of a positive group size."""
    if num_generations_eval < 1:
        raise ValueError(f"data.num_generations_eval={num_generations_eval}: it must be at least 1 (null: "
                         "data.num_generations).")
    if per_device_eval_batch_size < 1:
        raise ValueError(f"data.per_device_eval_batch_size={per_device_eval_batch_size}: it must be a positive "
                         f"multiple of data.num_generations_eval={num_generations_eval}.")
    if per_device_eval_batch_size % num_generations_eval:
        raise ValueError(
            f"data.per_device_eval_batch_size={per_device_eval_batch_size} is not a multiple of "
            f"data.num_generations_eval={num_generations_eval}: each validation step scores whole groups."
        )

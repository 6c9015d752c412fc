"""Batch-size bookkeeping (spec §1.1) and TRL's ``RepeatSampler`` prompt order (spec §1.2).

``PromptOrder`` gives the unique prompts of each generation batch as a pure function of
``(epoch, generation_in_epoch)``, so a resumed run continues with the same order without
replaying sampler state. No lightning here.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GenerationPlan:
    """How one generation batch is sized and cut (TRL ``GRPOConfig.__post_init__``).

    Attributes:
        generation_batch_size: Completions per generation batch, all ranks (``gbs``).
        steps_per_generation: Micro-batches per generation batch on each rank (``S``).
        prompts_per_generation: Unique prompts per generation batch (``gbs / num_generations``).
        local_rows: Completions per generation batch on one rank (``pdbs * S``).
    """

    generation_batch_size: int
    steps_per_generation: int
    prompts_per_generation: int
    local_rows: int


def _check_positive(value: int | None, key: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{key}={value!r}: it must be a positive integer.")


def plan_generation_batches(
    per_device_train_batch_size: int,
    num_generations: int,
    world_size: int,
    generation_batch_size: int | None = None,
    steps_per_generation: int | None = None,
    gradient_accumulation_steps: int = 1,
) -> GenerationPlan:
    """Derive the generation-batch sizes exactly as TRL does (spec §1.1).

    Args:
        per_device_train_batch_size: Completions per micro-batch per rank
            (``data.per_device_train_batch_size``).
        num_generations: Completions per prompt, ``G`` (``data.num_generations``).
        world_size: Number of training processes (``trainer.devices`` x ``trainer.num_nodes``).
        generation_batch_size: Completions per generation batch over all ranks
            (``data.generation_batch_size``); exclusive with ``steps_per_generation``.
        steps_per_generation: Micro-batches per generation batch (``data.steps_per_generation``).
        gradient_accumulation_steps: ``trainer.accumulate_grad_batches``; the default for
            ``steps_per_generation`` when neither it nor ``generation_batch_size`` is set.

    Returns:
        The resulting :class:`GenerationPlan`.

    Raises:
        ValueError: For non-positive values, both sizes set, a generation batch that the
            per-step batch does not divide, one that ``num_generations`` does not divide, or
            ``num_generations < 2``.
    """
    pdbs = per_device_train_batch_size
    _check_positive(pdbs, "data.per_device_train_batch_size")
    _check_positive(num_generations, "data.num_generations")
    _check_positive(world_size, "world size (trainer.devices x trainer.num_nodes)")
    _check_positive(generation_batch_size, "data.generation_batch_size")
    _check_positive(steps_per_generation, "data.steps_per_generation")
    _check_positive(gradient_accumulation_steps, "trainer.accumulate_grad_batches")
    per_step = pdbs * world_size
    if generation_batch_size is not None and steps_per_generation is not None:
        raise ValueError(
            f"data.generation_batch_size={generation_batch_size} and data.steps_per_generation="
            f"{steps_per_generation} are both set, but each determines the other "
            "(generation_batch_size = per_device_train_batch_size x world size x "
            "steps_per_generation): set only one of them."
        )
    if generation_batch_size is not None:
        if generation_batch_size % per_step != 0:
            raise ValueError(
                f"data.generation_batch_size={generation_batch_size} must be divisible by "
                f"data.per_device_train_batch_size x world size = {pdbs} x {world_size} = "
                f"{per_step} (trainer.devices x trainer.num_nodes processes), so that it splits "
                "into whole micro-batches: set it to a multiple of "
                f"{per_step}, or set data.steps_per_generation instead."
            )
        steps = generation_batch_size // per_step
    else:
        steps = steps_per_generation if steps_per_generation is not None else gradient_accumulation_steps
        generation_batch_size = per_step * steps
    if num_generations < 2:
        raise ValueError(
            f"data.num_generations={num_generations}: GRPO compares completions of the same "
            "prompt, so it needs at least 2 per prompt; set data.num_generations >= 2."
        )
    if generation_batch_size % num_generations != 0:
        raise ValueError(
            f"the generation batch holds {generation_batch_size} completions "
            f"(data.per_device_train_batch_size={pdbs} x world size {world_size} x "
            f"steps_per_generation {steps}, from data.generation_batch_size/"
            "data.steps_per_generation or else trainer.accumulate_grad_batches), which "
            f"data.num_generations={num_generations} does not divide: every prompt's group must "
            "fit in one generation batch. Change data.num_generations to a divisor of "
            f"{generation_batch_size}, or change data.per_device_train_batch_size, "
            "data.generation_batch_size or data.steps_per_generation so the total is a multiple "
            f"of {num_generations}."
        )
    return GenerationPlan(
        generation_batch_size=generation_batch_size,
        steps_per_generation=steps,
        prompts_per_generation=generation_batch_size // num_generations,
        local_rows=pdbs * steps,
    )


def data_seed(seed: int | None) -> int:
    """The seed of the data order: ``data.seed`` when set, else the global seed that Lightning's
    ``seed_everything`` recorded (``PL_GLOBAL_SEED``), else 42.

    >>> data_seed(7)
    7
    """
    return seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 42))


def shuffle_seed(seed: int, rank: int, epoch: int, generation: int) -> int:
    """Seed of the micro-batch shuffle of one generation batch on one rank.

    A hash (BLAKE2b) of the four numbers written out in full, so distinct ``(seed, rank, epoch,
    generation)`` give unrelated seeds: no arithmetic mix where, say, rank 1 of epoch 0 equals
    rank 0 of epoch 1.

    Args:
        seed: The data seed (``data.seed``, or the global seed).
        rank: Global rank.
        epoch: 0-based epoch.
        generation: Generation batch within the epoch.

    Returns:
        A non-negative 63-bit integer for ``torch.Generator.manual_seed``.

    >>> shuffle_seed(42, 1, 0, 0) != shuffle_seed(42, 0, 1, 0)
    True
    """
    key = f"{seed},{rank},{epoch},{generation}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class PromptOrder:
    """The unique prompts of each generation batch, in TRL ``RepeatSampler`` order.

    Epoch ``e`` uses the ``e``-th permutation drawn from a private ``torch.Generator`` seeded once
    with ``seed`` (identical to TRL), cut into chunks of ``prompts_per_generation``; the last
    partial chunk is dropped. Permutations are computed on demand and cached, so the answer
    depends only on the arguments, never on call history.

    Args:
        num_rows: Number of prompts in the dataset.
        prompts_per_generation: Unique prompts per generation batch
            (``generation_batch_size / num_generations``).
        shuffle: Draw a new permutation per epoch (``data.shuffle_dataset``); else dataset order.
        seed: Seed of the private generator (TRL's ``args.seed``).
    """

    def __init__(
        self, num_rows: int, prompts_per_generation: int, shuffle: bool = True, seed: int = 42
    ):
        if prompts_per_generation < 1:
            raise ValueError(f"prompts_per_generation={prompts_per_generation} must be >= 1.")
        if num_rows < prompts_per_generation:
            raise ValueError(
                f"the dataset has {num_rows} prompts but one generation batch needs "
                f"{prompts_per_generation} distinct prompts (generation_batch_size / "
                "num_generations), so not a single generation batch fits. Use a larger dataset, "
                "or lower data.per_device_train_batch_size / data.generation_batch_size / "
                "data.steps_per_generation, or raise data.num_generations."
            )
        self.num_rows = num_rows
        self.prompts_per_generation = prompts_per_generation
        self.shuffle = shuffle
        self.seed = seed
        self._generator: torch.Generator | None = None
        self._perms: list[torch.Tensor] = []  # (num_rows,) int64 per epoch drawn so far

    @property
    def generations_per_epoch(self) -> int:
        """Whole generation batches per epoch (the last partial chunk is dropped)."""
        return self.num_rows // self.prompts_per_generation

    def permutation(self, epoch: int) -> list[int]:
        """The full prompt order of ``epoch`` (before cutting into chunks).

        Args:
            epoch: 0-based epoch index.

        Returns:
            A permutation of ``range(num_rows)`` (the identity when not shuffling).
        """
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must be >= 0.")
        return self._permutation(epoch).tolist()

    def _permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_rows)
        if self._generator is None:
            self._generator = torch.Generator()
            self._generator.manual_seed(self.seed)
        while len(self._perms) <= epoch:
            self._perms.append(torch.randperm(self.num_rows, generator=self._generator))
        return self._perms[epoch]

    def prompt_indices(self, epoch: int, generation_in_epoch: int) -> list[int]:
        """Dataset row indices of the unique prompts of one generation batch.

        Args:
            epoch: 0-based epoch index.
            generation_in_epoch: 0-based generation batch within the epoch.

        Returns:
            ``prompts_per_generation`` distinct row indices, in sampler order.
        """
        if not 0 <= generation_in_epoch < self.generations_per_epoch:
            raise IndexError(
                f"generation_in_epoch={generation_in_epoch} is outside [0, "
                f"{self.generations_per_epoch}) for epoch {epoch}."
            )
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must be >= 0.")
        start = generation_in_epoch * self.prompts_per_generation
        return self._permutation(epoch)[start : start + self.prompts_per_generation].tolist()

    def state_dict(self) -> dict[str, int | bool]:
        """The settings that determine the order (to check a resumed run uses the same ones)."""
        return {
            "num_rows": self.num_rows,
            "prompts_per_generation": self.prompts_per_generation,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

"""The ``trainer_state`` reward functions receive: TRL's ``TrainerState`` fields, read from a
Lightning ``Trainer`` (which has no ``epoch`` and may say ``max_steps=-1``)."""

from __future__ import annotations

import math
from typing import Any

from grpo_lightning.data.micro_steps import MicroStepSchedule
from grpo_lightning.types import TrainerState


def build_trainer_state(trainer: Any, micro_steps: int, schedule: MicroStepSchedule | None) -> TrainerState:
    """The progress of ``trainer`` for a generation batch.

    Args:
        trainer: The Lightning ``Trainer``.
        micro_steps: Micro-steps trained before this batch (its own index for a training batch).
        schedule: The training schedule, or ``None`` when the run does not train
            (``grpo validate``).

    Returns:
        A :class:`TrainerState`; see its attributes for the exact definitions.
    """
    if schedule is None:
        epoch = float(trainer.current_epoch)
        max_steps = trainer.max_steps if trainer.max_steps >= 0 else math.inf
        max_epochs = trainer.max_epochs
        num_epochs = max_epochs if max_epochs is not None and max_epochs >= 0 else math.inf
    else:
        epoch = micro_steps / schedule.steps_per_epoch
        # Lightning's plan: max_steps, or from max_epochs (whichever ends the run first); inf if unbounded.
        max_steps = trainer.estimated_stepping_batches
        updates_per_epoch = math.ceil(schedule.steps_per_epoch / trainer.accumulate_grad_batches)
        num_epochs = math.ceil(max_steps / updates_per_epoch) if math.isfinite(max_steps) else math.inf
    return TrainerState(
        global_step=trainer.global_step,
        epoch=epoch,
        max_steps=int(max_steps) if math.isfinite(max_steps) else max_steps,
        num_train_epochs=num_epochs,
        is_world_process_zero=trainer.is_global_zero,
        trainer=trainer,
    )

"""Start-of-run summary and the data settings that can be checked before any model work."""

from __future__ import annotations

from typing import Any

from grpo_lightning.data.micro_steps import MicroStepSchedule
from grpo_lightning.data.rollout_builder import RolloutSettings
from grpo_lightning.errors import ConfigError

SCALE_CHOICES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def run_summary(settings: RolloutSettings, schedule: MicroStepSchedule, trainer: Any, reference: bool) -> str:
    """GRPO's batch arithmetic in a few lines: the most common source of confusion."""
    plan, accumulate = settings.plan, trainer.accumulate_grad_batches
    if trainer.max_steps is not None and trainer.max_steps > 0:
        planned = f"{trainer.max_steps} (trainer.max_steps)"
    elif trainer.max_epochs == -1:
        planned = "no limit (trainer.max_epochs=-1: runs until stopped)"
    else:
        epochs = trainer.max_epochs if trainer.max_epochs is not None else 1
        planned = f"{epochs * schedule.steps_per_epoch // accumulate} ({epochs} epoch(s))"
    per_step = trainer.world_size * accumulate * (plan.local_rows // plan.steps_per_generation)
    return "\n".join([
        "GRPO run summary",
        f"  world size {trainer.world_size}; micro-batch {plan.local_rows // plan.steps_per_generation} completions "
        f"per rank; accumulation {accumulate}",
        f"  generation batch: {plan.generation_batch_size} completions = {plan.prompts_per_generation} prompts x "
        f"{settings.num_generations}; cut into {plan.steps_per_generation} micro-batches per rank, replayed "
        f"{settings.num_iterations} time(s)",
        f"  optimizer step: {per_step} completions; {schedule.steps_per_epoch // accumulate} steps per epoch; "
        f"planned optimizer steps: {planned}",
        "  forward passes per micro-batch: " + "; ".join(_forward_passes(settings, reference)),
    ])


def _forward_passes(settings: RolloutSettings, reference: bool) -> list[str]:
    passes = ["policy (with grad)"]
    if settings.needs_old_logprobs:
        passes.append("old log-probs (no grad)")
    elif settings.corrects_sampling:
        passes.append("log-probs at generation for the importance-sampling correction (no grad)")
    if settings.corrects_sampling:
        correction = settings.importance_sampling
        passes.append(f"sampler IS correction {correction.mode} [{correction.clip_min}, {correction.clip_max}]")
    if reference:
        passes.append("reference log-probs (no grad)")
    return passes


def check_training_length(max_steps: int | None, max_epochs: int | None) -> None:
    """Reject a run length that trains nothing or that Lightning reads in surprising ways.

    ``-1`` means "no limit" for both (Lightning's convention); ``None`` leaves the choice to the other.
    """
    if max_steps is not None and (max_steps == 0 or max_steps < -1):
        raise ConfigError(
            f"trainer.max_steps={max_steps}: a run needs at least one optimizer step. Set a positive number of "
            "steps, or -1 to let trainer.max_epochs decide the length."
        )
    if max_epochs is not None and (max_epochs == 0 or max_epochs < -1):
        raise ConfigError(
            f"trainer.max_epochs={max_epochs}: a run needs at least one epoch. Set a positive number of epochs, "
            "-1 for no epoch limit, or null to train for trainer.max_steps."
        )


def check_trainer_settings(trainer: Any) -> None:
    """Reject trainer settings Lightning accepts but that train wrongly or fail after the first step:
    the run length (:func:`check_training_length`), a negative clip threshold (clipping to a
    negative norm flips every gradient: gradient ascent),
    and intervals of 0 (a division by zero once logging or validation is due; no training at all).

    ``trainer``: a Lightning ``Trainer``, or the CLI's ``trainer`` config section (same names).
    Lightning leaves ``val_check_interval`` unset for a time interval (``"00:00:10:00"``).

    >>> from types import SimpleNamespace as Settings
    >>> check_trainer_settings(Settings(gradient_clip_val=1.0, log_every_n_steps=10, val_check_interval=None,
    ...                                 check_val_every_n_epoch=1, limit_train_batches=1.0))
    >>> check_trainer_settings(Settings(gradient_clip_val=-1.0, log_every_n_steps=10))
    Traceback (most recent call last):
    ...
    grpo_lightning.errors.ConfigError: trainer.gradient_clip_val=-1.0: ...
    """
    check_training_length(getattr(trainer, "max_steps", None), getattr(trainer, "max_epochs", None))
    gradient_clip_val = getattr(trainer, "gradient_clip_val", None)
    limit_train_batches = getattr(trainer, "limit_train_batches", None)
    if gradient_clip_val is not None and gradient_clip_val < 0:
        raise ConfigError(
            f"trainer.gradient_clip_val={gradient_clip_val}: it must be > 0 (the largest gradient norm or value "
            "kept), or null / 0 for no clipping. A negative threshold would flip the gradients' sign."
        )
    for key in ("log_every_n_steps", "val_check_interval", "check_val_every_n_epoch"):
        value = getattr(trainer, key, None)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)  # not a time ("00:00:10:00")
        if numeric and value <= 0:
            raise ConfigError(
                f"trainer.{key}={value}: it must be positive (every how many steps or epochs); to turn "
                f"{'logging' if key == 'log_every_n_steps' else 'validation'} off use "
                f"{'trainer.logger: false' if key == 'log_every_n_steps' else 'trainer.limit_val_batches: 0'}."
            )
    if limit_train_batches is not None and limit_train_batches == 0:
        raise ConfigError(
            "trainer.limit_train_batches=0 trains nothing: give a positive number of micro-batches (or a fraction "
            "of the epoch), or run `grpo validate` to evaluate without training."
        )


def check_data_settings(reward_funcs: Any, num_iterations: int, scale_rewards: Any,
                        multi_objective_aggregation: str) -> None:
    """The datamodule's settings that need no dataset, model or world size."""
    if not reward_funcs:
        raise ValueError("data.reward_funcs is empty: give at least one reward function.")
    if num_iterations < 1:
        raise ValueError(f"data.num_iterations={num_iterations}: it must be >= 1.")
    if isinstance(scale_rewards, str) and scale_rewards not in SCALE_CHOICES:
        raise ValueError(f"data.scale_rewards={scale_rewards!r}: use one of {SCALE_CHOICES} (or true/false).")
    if multi_objective_aggregation not in AGGREGATIONS:
        raise ValueError(f"data.multi_objective_aggregation={multi_objective_aggregation!r}: use one of {AGGREGATIONS}.")


def check_sizes(
    num_generations: int, per_device_train_batch_size: int, generation_batch_size: int | None, steps_per_generation: int | None
) -> None:
    if num_generations < 2:
        raise ValueError(
            f"data.num_generations={num_generations}: GRPO compares completions within a group, so it "
            "needs at least 2 completions per prompt."
        )
    if per_device_train_batch_size < 1:
        raise ValueError(f"data.per_device_train_batch_size={per_device_train_batch_size}: it must be >= 1.")
    if generation_batch_size is not None and steps_per_generation is not None:
        raise ValueError(
            f"data.generation_batch_size={generation_batch_size} and data.steps_per_generation="
            f"{steps_per_generation} are both set, but each determines the other: set only one."
        )
    if generation_batch_size is not None and generation_batch_size % num_generations:
        raise ValueError(
            f"data.generation_batch_size={generation_batch_size} is not a multiple of data.num_generations="
            f"{num_generations}: every prompt's group must fit in one generation batch."
        )

"""What transformers' ``Trainer`` computes for its ``TrainerState`` and its end-of-training summary,
read from a Lightning run (``TrainerCallbacks`` uses these).

transformers works these out in ``Trainer.set_initial_training_values`` (the run's length) and
``Trainer._finalize_training`` (the summary, with ``trainer_utils.speed_metrics``); the functions
here follow those formulas, with Lightning's ``Trainer`` as the source of the counts.

Layer L7 (trl_compat).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any


def planned_steps(trainer: Any) -> int | None:
    """The optimizer steps the run will take: ``max_steps``, or what the epochs amount to
    (Lightning's ``estimated_stepping_batches``, which counts an epoch's last partial accumulation
    as a step, as transformers does); ``None`` when the run has no known end."""
    try:
        steps = trainer.estimated_stepping_batches
    except Exception:  # no training dataloader (grpo validate) or an unbounded run
        steps = math.inf
    if math.isfinite(steps):
        return int(steps)
    return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None


def planned_steps_at_setup(trainer: Any) -> int | None:
    """:func:`planned_steps` before the training loader exists (a callback's ``setup``, where a
    setting that follows from it must be fixed before a checkpoint's callback states load): the
    epochs' steps from the datamodule's micro-step schedule, as Lightning's
    ``estimated_stepping_batches`` counts them; ``max_steps`` when there is no schedule."""
    max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
    schedule = getattr(getattr(trainer, "datamodule", None), "schedule", None)
    if schedule is None or trainer.max_epochs is None or trainer.max_epochs < 0:
        return max_steps
    batches, limit = schedule.steps_per_epoch, trainer.limit_train_batches
    batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    steps = math.ceil(batches / trainer.accumulate_grad_batches) * max(trainer.max_epochs, 1)
    return min(steps, max_steps) if max_steps else steps


def _batches_per_epoch(trainer: Any) -> int | None:
    """Micro-batches in one epoch (transformers' ``len(train_dataloader)``), or ``None`` if unknown."""
    batches = getattr(trainer, "num_training_batches", None)
    return int(batches) if isinstance(batches, (int, float)) and math.isfinite(batches) and batches > 0 else None


def num_train_epochs(trainer: Any, args: Any, max_steps: int | None) -> int | float:
    """``state.num_train_epochs`` as transformers sets it: the whole epochs ``max_steps`` reaches
    (``max_steps`` set), else ``ceil(args.num_train_epochs)``; ``sys.maxsize`` for a dataset
    without a length (transformers then loops over it until ``max_steps``)."""
    batches = _batches_per_epoch(trainer)
    if batches is None:
        return sys.maxsize if args.max_steps > 0 else args.num_train_epochs
    if args.max_steps > 0 and max_steps:
        updates_per_epoch = max(math.ceil(batches / trainer.accumulate_grad_batches), 1)
        return math.ceil(max_steps / updates_per_epoch)
    return math.ceil(args.num_train_epochs)


def num_train_samples(trainer: Any, args: Any, max_steps: int | None) -> float:
    """transformers' ``num_train_samples`` (the samples of the whole schedule): ``max_steps`` times
    the total batch (``per_device_train_batch_size × gradient_accumulation_steps × world size``:
    completions) when ``max_steps`` is set or the dataset has no length, else the dataset's rows
    times ``num_train_epochs`` (TRL's dataloader dataset is the prompt dataset: prompts)."""
    total_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * trainer.world_size
    rows = _dataset_rows(trainer)
    if args.max_steps > 0 or rows is None or _batches_per_epoch(trainer) is None:
        return float((max_steps or 0) * total_batch)
    return rows * args.num_train_epochs


def _dataset_rows(trainer: Any) -> int | None:
    dataset = getattr(getattr(trainer, "datamodule", None), "train_dataset", None)
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:  # a stream
        return None


def speed_metrics(split: str, start_time: float, num_samples: float | None = None,
                  num_steps: int | None = None) -> dict[str, float]:
    """transformers' ``trainer_utils.speed_metrics``: ``<split>_runtime`` (rounded to 4 digits) and
    the samples and steps per second (rounded to 3), measured from ``start_time`` (``time.time()``)."""
    runtime = time.time() - start_time
    result = {f"{split}_runtime": round(runtime, 4)}
    if runtime == 0:
        return result
    if num_samples is not None:
        result[f"{split}_samples_per_second"] = round(num_samples / runtime, 3)
    if num_steps is not None:
        result[f"{split}_steps_per_second"] = round(num_steps / runtime, 3)
    return result


def train_summary(start_time: float, steps_trained: int, max_steps: int | None, samples: float,
                  train_loss: float) -> dict[str, float]:
    """The end-of-training metrics of ``Trainer._finalize_training``, in its order: runtime, samples
    and steps per second (this call's share of the schedule's samples), ``total_flos``, ``train_loss``."""
    metrics = speed_metrics("train", start_time, num_samples=samples * steps_trained / max(max_steps or 0, 1),
                            num_steps=steps_trained)
    # grpo-lightning does not count FLOPs (transformers estimates 6 x tokens x parameters per
    # forward-backward); the key is kept, at 0.0, for code that reads it.
    metrics["total_flos"] = 0.0
    metrics["train_loss"] = train_loss
    return metrics


def absolute_steps(value: float | None, max_steps: int | None) -> float | None:
    """``logging_steps`` / ``eval_steps`` / ``save_steps`` as ``state`` holds them: a value below 1 is
    a fraction of ``max_steps`` (``ceil``), as transformers resolves it at the start of training."""
    if value is not None and 0 < value < 1 and max_steps:
        return math.ceil(max_steps * value)
    return value

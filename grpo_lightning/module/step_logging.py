"""Logging the training metrics, from a callback so that a step is logged before its checkpoint.

Lightning calls every callback's ``on_train_batch_end`` before the module's, and moves
``ModelCheckpoint`` callbacks to the end of the list. Metrics logged from the module's own hook
would reach MLflow *after* that step's checkpoint is written, and a run killed in between would
resume after a step it never logged. :class:`FlushStepLogs`, returned by
``GRPOModule.configure_callbacks``, logs from the callback list instead, ahead of every
checkpoint, and its state (the metrics gathered since the last log, ``log_every_n_steps > 1``)
travels in the checkpoint as any callback's does: a resumed run logs the same averages.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl

from grpo_lightning.module.metrics import TrainingMetrics


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """``metrics`` to every logger of ``trainer``, at its global step."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


class FlushStepLogs(pl.Callback):
    """Times the micro-batches of a step and logs ``metrics`` (TRL's averages since the last log)
    every ``trainer.log_every_n_steps`` optimizer steps, when training stops and at an epoch's end."""

    def __init__(self, metrics: TrainingMetrics) -> None:
        self.metrics = metrics
        self.last_global_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.last_global_step = trainer.global_step  # a resumed run's step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.metrics.batch_started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.last_global_step:  # still accumulating
            self.metrics.seconds += time.perf_counter() - self.metrics.batch_started
            return
        self.last_global_step = trainer.global_step
        if trainer.global_step % trainer.log_every_n_steps == 0 or trainer.should_stop:
            self.flush(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.metrics:
            self.flush(trainer)

    def flush(self, trainer: pl.Trainer) -> None:
        log_metrics(trainer, {**self.metrics.flush_log(), "epoch": float(trainer.current_epoch)})

    def state_dict(self) -> dict[str, Any]:
        return self.metrics.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.metrics.load_state_dict(state_dict)

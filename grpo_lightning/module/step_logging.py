"""Logging the training metrics, from a callback so that a step is logged before its checkpoint.

Lightning calls every callback's ``on_train_batch_end`` before the module's, and moves
``ModelCheckpoint`` callbacks to the end of the list. Metrics logged from the module's own hook
would reach MLflow *after* that step's checkpoint is written, and a run killed in between would
resume after a step it never logged. :class:`FlushStepLogs`, returned by
``GRPOModule.configure_callbacks``, logs from the callback list instead, ahead of every
checkpoint, and its state (the metrics gathered since the last log, ``log_every_n_steps > 1``)
travels in the checkpoint as any callback's does: a resumed run logs the same averages.
:func:`log_evaluation` logs an evaluation's metrics, inside ``fit`` or standalone.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from grpo_lightning.module.metrics import MetricsWindow, TrainingMetrics


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """``metrics`` to every logger of ``trainer``, at its global step."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def fractional_epoch(trainer: pl.Trainer, batch_idx: int) -> float:
    """The HF Trainer's ``epoch``: epochs done plus the share of this epoch's batches done
    (``batch_idx`` the last finished one); the epoch number when the count is unknown."""
    batches = trainer.num_training_batches
    fraction = (batch_idx + 1) / batches if isinstance(batches, int) and batches else 0.0
    return trainer.current_epoch + fraction


def log_evaluation(module: pl.LightningModule, windows: dict[str, MetricsWindow]) -> None:
    """One evaluation's ``eval_*`` metrics (each named set's window, under its prefix): in
    ``trainer.callback_metrics`` for callbacks (``ModelCheckpoint(monitor="eval_reward")``), and
    to the loggers. Standalone (``grpo validate``, ``trainer.validate``) through Lightning's logging,
    which prints the results table and returns the metrics; inside ``fit`` straight to the loggers
    at the current optimizer step."""
    trainer = module.trainer
    standalone = trainer.state.fn == TrainerFn.VALIDATING
    for prefix, window in windows.items():
        metrics = {prefix + k: v for k, v in window.flush().items() if not math.isnan(v)}
        if not standalone:
            log_metrics(trainer, metrics)
        for name, value in metrics.items():
            module.log(name, value, logger=standalone, prog_bar=name == prefix + "reward")


class FlushStepLogs(pl.Callback):
    """Times the micro-batches of a step and logs ``metrics`` (TRL's averages since the last log)
    every ``trainer.log_every_n_steps`` optimizer steps, and (``flush_at_boundaries``, the default)
    when training stops and at an epoch's end.

    Args:
        metrics: The module's training metrics.
        flush_at_boundaries: Also log when training stops and at each epoch's end, so that no step
            goes unlogged (``grpo fit``). ``False`` logs at multiples of ``log_every_n_steps`` only,
            the window carrying over an epoch's end into the next log, as transformers' ``Trainer``
            does with ``logging_strategy="steps"`` (``GRPOTrainer`` turns it off:
            ``grpo_lightning.trl_compat.flow.TRLStepFlow``).
        log_first_step: Also log the first optimizer step (transformers' ``logging_first_step``).
    """

    def __init__(self, metrics: TrainingMetrics, flush_at_boundaries: bool = True, log_first_step: bool = False) -> None:
        self.metrics = metrics
        self.flush_at_boundaries = flush_at_boundaries
        self.log_first_step = log_first_step
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
        if (trainer.global_step % trainer.log_every_n_steps == 0 or (self.flush_at_boundaries and trainer.should_stop)
                or (self.log_first_step and trainer.global_step == 1)):
            self.flush(trainer, fractional_epoch(trainer, batch_idx))
        elif self.flush_at_boundaries and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and self.metrics:
            # the epoch's end, logged here rather than in on_train_epoch_end: before this step's
            # checkpoint (Lightning runs ModelCheckpoint last), which must not carry these metrics
            # into a resumed run's next log
            self.flush(trainer, trainer.current_epoch + 1.0)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.flush_at_boundaries and self.metrics:
            self.flush(trainer, trainer.current_epoch + 1.0)

    def flush(self, trainer: pl.Trainer, epoch: float) -> None:
        """Log the metrics gathered since the last log, with the (fractional) ``epoch``, as TRL. A
        logger that fails (a tracking server's error) leaves them gathered: the checkpoint written
        on that failure holds them, and the resumed run logs them."""
        gathered = self.metrics.state_dict()
        try:
            log_metrics(trainer, {**self.metrics.flush_log(), "epoch": float(epoch)})
        except BaseException:
            self.metrics.load_state_dict(gathered)
            raise

    def state_dict(self) -> dict[str, Any]:
        return self.metrics.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.metrics.load_state_dict(state_dict)

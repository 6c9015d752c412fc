"""A checkpoint written in the middle of some work records Lightning's progress at that work's start.

Two cases, both for checkpoints written between optimizer-step ends (``on_exception.ckpt`` after a
failure, a ``trainer.save_checkpoint`` from a user's hook):

* **inside an accumulation window**: the module's part of ``utils/accumulation_window.py``. The
  datamodule's position and the module's metrics already go back to the window's start; the
  checkpoint's training batch progress goes back with them, so Lightning fetches and trains the
  window's micro-steps again.
* **during a validation at a step's end**: Lightning would resume after it (a failure while an
  evaluation batch was generated looks like a finished validation) or run only the batches it had
  not finished, from the first one (its evaluation loader starts over). The validation progress is
  set to "restarting at its first batch", so the whole validation runs again, with fresh metrics;
  its generations are seeded by step and batch (``data/evaluation.py``), so it is the same one.
  A validation inside a window needs nothing: the window is trained again and validates again.

A callback (``GRPOModule.configure_callbacks``) rather than the module's ``on_save_checkpoint``,
which a subclass may override without calling ``super()``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from grpo_lightning.utils.accumulation_window import micro_steps_into_window, rewind_batch_progress


def restart_validation(loops: dict[str, Any]) -> None:
    """Set a checkpoint's fit-time validation progress (``checkpoint["loops"]``) to a validation
    restarting at its first batch: Lightning's "restarted mid-evaluation" with nothing finished."""
    progress = loops["fit_loop"]["epoch_loop.val_loop.batch_progress"]
    before = progress["total"]["completed"] - progress["current"]["completed"]  # this epoch's earlier validations
    progress["total"] = {"ready": before + 1, "started": before + 1, "processed": before, "completed": before}
    progress["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    progress["is_last_batch"] = False


class RestartPoints(pl.Callback):
    """Rewinds a checkpoint written inside an accumulation window to the window's start, and one
    written during a fit's validation to that validation's start."""

    def __init__(self) -> None:
        self._validation_running = False  # between a fit's validation start and its end

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_running = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_running = False  # before the checkpoints' hooks: one written now follows a whole validation

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if "loops" not in checkpoint:
            return
        into_window = micro_steps_into_window(trainer)
        rewind_batch_progress(checkpoint["loops"], into_window)
        if into_window == 0 and self._validation_running:
            restart_validation(checkpoint["loops"])

"""The module's end-of-batch logging, run as a callback so that it comes before the checkpoints.

Lightning calls every callback's ``on_train_batch_end`` before the module's, and moves
``ModelCheckpoint`` callbacks to the end of the list. A step's metrics logged from the module's own
hook therefore reach MLflow *after* that step's checkpoint is written: a run killed in between
resumes after the step and never logs it. :class:`FlushStepLogs`, returned by
``GRPOModule.configure_callbacks``, runs the module's end-of-batch and end-of-epoch logging from the
callback list, ahead of any checkpoint; the window of metrics not yet logged travels in the
checkpoint (``TrainingMetrics.state_dict``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


class FlushStepLogs(pl.Callback):
    """Calls ``pl_module.end_train_batch()`` / ``pl_module.end_train_epoch()`` (module docstring)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        pl_module.end_train_batch()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        pl_module.end_train_epoch()

"""A checkpoint written inside an accumulation window records Lightning's progress at its start.

The module's part of ``utils/accumulation_window.py``: the datamodule's position and the module's
metrics already go back to the window's start; this callback sets the checkpoint's training batch
progress back with them, so Lightning fetches and trains the window's micro-steps again. A
callback (``GRPOModule.configure_callbacks``) rather than the module's ``on_save_checkpoint``,
which a subclass may override without calling ``super()``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from grpo_lightning.utils.accumulation_window import micro_steps_into_window, rewind_batch_progress


class WindowStartCheckpoints(pl.Callback):
    """Rewinds a checkpoint written inside an accumulation window to the window's start."""

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if "loops" in checkpoint:
            rewind_batch_progress(checkpoint["loops"], micro_steps_into_window(trainer))

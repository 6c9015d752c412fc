"""The run's every-``checkpoint_every_n_steps`` checkpoint, written again after a validation that follows it.

Lightning writes a step's checkpoint at the step's last batch end and runs the validation due at
that step after it; a run resumed from that checkpoint skips the validation (it counts as done
at the restored step) without what it changed: ``EarlyStopping``'s patience, ``SaveBestPolicy``'s
best value, a monitored checkpoint's ranking, GRPOTrainer's ``log_history``. So when a validation
follows, the checkpoint is written once more when it ends, over the same file: a run killed during
the validation resumes from the first write (without that validation), one killed after it from
the second (with it). The cost is one more write of the steps where a checkpoint and a
validation fall together; intervals that do not coincide avoid it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


def validation_follows(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates after the training batch that is ending (read in a callback's
    ``on_train_batch_end``, where every other callback, ``should_stop`` included, has had its say)."""
    loop, fetcher = trainer.fit_loop.epoch_loop, trainer.fit_loop._data_fetcher  # private in Lightning 2.x
    return fetcher is not None and not loop._skip_next_val and loop._should_check_val_fx(fetcher)


class PeriodicCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` whose step checkpoint is written again after the validation that follows it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._written: tuple[int, str] | None = None  # (global step, file) of the latest write
        self._rewrite_after_validation = False

    @property
    def state_key(self) -> str:
        """A plain ``ModelCheckpoint``'s: checkpoints written before this class resume with its state."""
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        self._written = (trainer.global_step, filepath)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        written_now = self._written is not None and self._written[0] == trainer.global_step
        self._rewrite_after_validation = written_now and validation_follows(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._rewrite_after_validation and self._written is not None and self._written[0] == trainer.global_step:
            self._rewrite_after_validation = False
            super()._save_checkpoint(trainer, self._written[1])

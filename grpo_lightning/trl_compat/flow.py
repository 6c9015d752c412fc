"""``TRLStepFlow``: the parts of transformers' ``DefaultFlowCallback`` that a ``grpo fit`` run does
otherwise, for the runs ``GRPOTrainer`` builds (``convert.convert_config`` puts it in their ``trainer.callbacks``,
so ``grpo fit`` of their YAML file does the same).

* **Step logs** happen at multiples of ``logging_steps`` only (``logging_strategy="steps"``): the
  module's ``FlushStepLogs`` also logs when training stops and at each epoch's end, which transformers
  does not; here that is turned off, and the metrics gathered since the last log carry over into the
  next one (across an epoch's end), or into the end-of-training summary (``TrainerCallbacks``).
* **A final evaluation** with ``eval_strategy="steps"``: transformers evaluates once more at the last
  step when it is not an evaluation step (``DefaultFlowCallback.on_step_end``). Lightning validates
  at a step when training is asked to stop there (``trainer.should_stop``, as early stopping does),
  and only once whether or not the step is a ``val_check_interval`` step, so the last step asks it.

In YAML::

    trainer:
      callbacks:
        - class_path: grpo_lightning.trl_compat.flow.TRLStepFlow
          init_args: {evaluate_at_end: true}

Layer L7 (trl_compat).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl

from grpo_lightning.cli.checkpoints import is_periodic_checkpoint
from grpo_lightning.errors import ConfigError
from grpo_lightning.module.step_logging import FlushStepLogs
from grpo_lightning.trl_compat.run_state import planned_steps, planned_steps_at_setup


class TRLStepFlow(pl.Callback):
    """Step logs at multiples of ``log_every_n_steps`` only, and (``evaluate_at_end``) an evaluation
    at the last optimizer step, as transformers' ``Trainer`` does.

    Args:
        evaluate_at_end: Validate at the last step of the run even when it is not a
            ``val_check_interval`` step (``eval_strategy="steps"`` with an evaluation set).
        log_first_step: Also log the first optimizer step (``logging_first_step``).
        logging_fraction: Log every ``ceil(fraction x planned steps)`` optimizer steps
            (``logging_steps`` below 1 in a run of ``num_train_epochs``, whose steps are known
            once the data is set up); sets ``trainer.log_every_n_steps`` then. ``None``: as configured.
        eval_fraction: Likewise, validate every ``ceil(fraction x planned steps)`` optimizer steps
            (``eval_steps`` below 1); sets ``trainer.val_check_interval``.
        save_fraction: Likewise, write the periodic checkpoint every ``ceil(fraction x planned
            steps)`` optimizer steps (``save_steps`` below 1; ``checkpoint_every_n_steps``).
    """

    def __init__(self, evaluate_at_end: bool = False, log_first_step: bool = False,
                 logging_fraction: float | None = None, eval_fraction: float | None = None,
                 save_fraction: float | None = None) -> None:
        for name, fraction in (("logging_fraction", logging_fraction), ("eval_fraction", eval_fraction),
                               ("save_fraction", save_fraction)):
            if fraction is not None and not 0 < fraction < 1:
                raise ValueError(f"{name}={fraction}: use a fraction in (0, 1), or null.")
        self.evaluate_at_end = evaluate_at_end
        self.log_first_step = log_first_step
        self.logging_fraction, self.eval_fraction, self.save_fraction = logging_fraction, eval_fraction, save_fraction
        self._last_step: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The module's callbacks are attached before setup: FlushStepLogs is in the list now.
        for callback in trainer.callbacks:
            if isinstance(callback, FlushStepLogs):
                callback.flush_at_boundaries = False
                callback.log_first_step = self.log_first_step
        if stage == "fit":
            self._resolve_fractions(trainer)

    def _resolve_fractions(self, trainer: pl.Trainer) -> None:
        """The intervals given as fractions of the run, in steps (transformers' ``ceil`` rule). At
        setup: before the training loader is built (Lightning reads ``val_check_interval`` then)
        and before a resumed checkpoint's callback states load (a ``ModelCheckpoint``'s state is
        keyed by its interval)."""
        if self.logging_fraction is None and self.eval_fraction is None and self.save_fraction is None:
            return
        planned = planned_steps_at_setup(trainer)
        if planned is None:
            raise ConfigError("TRLStepFlow: logging, evaluation or checkpoint steps are given as a fraction of the "
                              "run, whose length is unknown (no max_steps, no epoch count): give them as steps.")

        def every(fraction: float) -> int:
            return max(1, math.ceil(planned * fraction))

        if self.logging_fraction is not None:
            trainer.log_every_n_steps = every(self.logging_fraction)
        if self.eval_fraction is not None:  # Lightning counts training batches: accumulate_grad_batches a step
            trainer.val_check_interval = every(self.eval_fraction) * trainer.accumulate_grad_batches
        if self.save_fraction is not None:
            for callback in trainer.checkpoint_callbacks:
                if is_periodic_checkpoint(callback):
                    callback._every_n_train_steps = every(self.save_fraction)  # private in Lightning 2.x

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = planned_steps(trainer) if self.evaluate_at_end else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._last_step is not None and trainer.global_step >= self._last_step:
            # The run ends after this step anyway; asking it to stop makes Lightning validate here (once).
            trainer.should_stop = True

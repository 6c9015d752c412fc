"""``CompletionLogger``: TRL's ``log_completions`` as a Lightning callback."""

from __future__ import annotations

import logging
import os
from typing import Any

import lightning.pytorch as pl

from grpo_lightning.types import CompletionTable

log = logging.getLogger(__name__)


class CompletionLogger(pl.Callback):
    """Logs the prompts, completions, rewards and advantages of training generation batches.

    Each log holds the latest generation batch of all ranks, with every ``log_extra`` column of
    the reward functions. With an MLflow logger the table is logged to the run
    (``completions/completions_<step>.json``, viewable in the MLflow UI); it is also written as
    parquet under ``<trainer.default_root_dir>/completions/``.

    Args:
        every_n_steps: Log every this many optimizer steps (default: ``trainer.log_every_n_steps``).
        num_completions_to_print: Rows printed to the console at each log (0: none).
        log_unique_prompts: Keep only the first completion of each prompt.
        save_parquet: Also write ``completions_<step>.parquet`` files.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        num_completions_to_print: int = 0,
        log_unique_prompts: bool = False,
        save_parquet: bool = True,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"CompletionLogger.every_n_steps={every_n_steps}: use a positive number or null.")
        self.every_n_steps = every_n_steps
        self.num_completions_to_print = num_completions_to_print
        self.log_unique_prompts = log_unique_prompts
        self.save_parquet = save_parquet
        self._last_logged_step = -1

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not hasattr(trainer.datamodule, "collect_completions"):
            raise TypeError("CompletionLogger needs a RolloutDataModule (trainer.datamodule.collect_completions).")
        trainer.datamodule.collect_completions = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        every = self.every_n_steps or trainer.log_every_n_steps
        table = trainer.datamodule.completion_table
        if table is None or step == self._last_logged_step or step == 0 or step % every:
            return
        self._last_logged_step = step
        if trainer.is_global_zero:
            self.write(trainer, self._rows(table), step)

    def _rows(self, table: CompletionTable) -> dict[str, list[Any]]:
        if not self.log_unique_prompts:
            return table.columns
        first: dict[str, int] = {}
        for i, prompt in enumerate(table.columns["prompt"]):
            first.setdefault(prompt, i)
        keep = sorted(first.values())
        return {name: [values[i] for i in keep] for name, values in table.columns.items()}

    def write(self, trainer: pl.Trainer, columns: dict[str, list[Any]], step: int) -> None:
        """Send one table to the loggers, the parquet folder and the console."""
        from lightning.pytorch.loggers import MLFlowLogger

        columns = {"step": [step] * len(columns["prompt"]), **columns}
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                logger.experiment.log_table(logger.run_id, data=columns, artifact_file=f"completions/completions_{step:05d}.json")
        if self.save_parquet:
            import pandas as pd

            folder = os.path.join(trainer.default_root_dir, "completions")
            os.makedirs(folder, exist_ok=True)
            pd.DataFrame(columns).to_parquet(os.path.join(folder, f"completions_{step:05d}.parquet"))
        for i in range(min(self.num_completions_to_print, len(columns["prompt"]))):
            rewards = {k: v[i] for k, v in columns.items() if k.startswith("reward/")}
            log.info("step %d | prompt %r | completion %r | %s | advantage %.3f",
                     step, columns["prompt"][i], columns["completion"][i], rewards, columns["advantage"][i])

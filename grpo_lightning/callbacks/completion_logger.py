"""``CompletionLogger``: TRL's ``log_completions`` as a Lightning callback."""

from __future__ import annotations

import logging
import os
from typing import Any

import lightning.pytorch as pl

from grpo_lightning.callbacks.completion_hub import CompletionHub
from grpo_lightning.callbacks.completion_table import (
    pick_columns, print_completions, sample_rows, unique_prompt_rows, without_images,
)
from grpo_lightning.types import CompletionTable

log = logging.getLogger(__name__)


class CompletionLogger(pl.Callback):
    """Logs the prompts, completions, rewards and advantages of training generation batches.

    Each log holds the latest generation batch of all ranks, with every ``log_extra`` column of
    the reward functions, and happens on rank 0 only. With an MLflow logger the table is logged to
    the run (``completions/completions_<step>.json``, viewable in the MLflow UI); it is also written
    as parquet under ``<trainer.default_root_dir>/completions/`` and printed as a ``rich`` table.

    Args:
        every_n_steps: Log every this many optimizer steps (default: ``trainer.log_every_n_steps``).
        num_completions_to_print: Rows of the printed table (a fixed sample per step); ``null``
            prints them all (TRL's default), ``0`` prints nothing.
        log_unique_prompts: The printed table and the MLflow table show each prompt once (its
            first completion); the parquet files and the Hub dataset keep every row, as in TRL.
        save_parquet: Write ``completions_<step>.parquet`` files (needed by
            ``log_completions_hub_repo``).
        log_completions_hub_repo: A Hub dataset repository (``user/name``, ``org/name`` or
            ``name``) that receives every logged row (``docs/evaluation.md``). Created before the
            first step; public unless ``hub_private_repo`` (or the organisation's default).
        hub_private_repo: Create ``log_completions_hub_repo`` private.
        hub_push_interval_s: Least seconds between two Hub pushes at logging steps (TRL commits
            every 2 minutes); the last rows are always pushed when fit ends.
        log_multimodal: Put each row's image (vision-language prompts: the row's first image) in
            the MLflow table as an image artifact (TRL's ``log_multimodal``); ``false`` keeps the logs
            small with high-resolution images. Parquet, console and Hub rows never hold images.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        num_completions_to_print: int | None = None,
        log_unique_prompts: bool = False,
        save_parquet: bool = True,
        log_completions_hub_repo: str | None = None,
        hub_private_repo: bool | None = None,
        hub_push_interval_s: float = 120.0,
        log_multimodal: bool = True,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"CompletionLogger.every_n_steps={every_n_steps}: use a positive number or null.")
        if num_completions_to_print is not None and num_completions_to_print < 0:
            raise ValueError(f"CompletionLogger.num_completions_to_print={num_completions_to_print}: use 0 or more "
                             "rows, or null for all.")
        if log_completions_hub_repo is not None and not save_parquet:
            raise ValueError("CompletionLogger.log_completions_hub_repo pushes the parquet files: set "
                             "save_parquet: true, or remove log_completions_hub_repo.")
        self.every_n_steps = every_n_steps
        self.num_completions_to_print = num_completions_to_print
        self.log_unique_prompts = log_unique_prompts
        self.save_parquet = save_parquet
        self.log_multimodal = log_multimodal
        self.hub = None if log_completions_hub_repo is None else CompletionHub(
            log_completions_hub_repo, hub_private_repo, hub_push_interval_s)
        self.console: Any = None  # a rich Console to print to (tests); None: stdout
        self._last_logged_step = -1

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not hasattr(trainer.datamodule, "collect_completions"):
            raise TypeError("CompletionLogger needs a RolloutDataModule (trainer.datamodule.collect_completions).")
        trainer.datamodule.collect_completions = True
        if stage == "fit" and self.hub is not None and trainer.is_global_zero:
            log.info("Completions go to the Hub dataset %s.", self.hub.create())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a resumed run's restored step was logged before its checkpoint was written
        self._last_logged_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        every = self.every_n_steps or trainer.log_every_n_steps
        table = trainer.datamodule.completion_table
        if table is None or step == self._last_logged_step or step == 0 or step % every:
            return
        self._last_logged_step = step
        if trainer.is_global_zero:
            self.write(trainer, table, step)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.hub is not None and trainer.is_global_zero:
            self.hub.flush(self.folder(trainer))  # the rows since the last push, also after an error

    @staticmethod
    def folder(trainer: pl.Trainer) -> str:
        """Where the parquet files go: ``<default_root_dir>/completions``."""
        return os.path.join(trainer.default_root_dir, "completions")

    def write(self, trainer: pl.Trainer, table: CompletionTable | dict[str, list[Any]], step: int) -> None:
        """Send one table to the loggers, the parquet folder, the console and the Hub."""
        from lightning.pytorch.loggers import MLFlowLogger

        columns = table.columns if isinstance(table, CompletionTable) else table
        columns = {"step": [step] * len(columns["prompt"]), **columns}
        columns, images = without_images(columns)  # PIL images: MLflow only
        shown = unique_prompt_rows(columns["prompt"]) if self.log_unique_prompts else range(len(columns["prompt"]))
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                logger.experiment.log_table(logger.run_id, data=pick_columns({**columns, **images} if self.log_multimodal
                                                                             else columns, shown),
                                            artifact_file=f"completions/completions_{step:05d}.json")
        if self.save_parquet:
            import pandas as pd

            os.makedirs(self.folder(trainer), exist_ok=True)
            pd.DataFrame(columns).to_parquet(os.path.join(self.folder(trainer), f"completions_{step:05d}.parquet"))
        printed = sample_rows(shown, self.num_completions_to_print, seed=step)
        if printed:
            print_completions(pick_columns(columns, printed), step, self.console)
        if self.hub is not None:
            self.hub.logged(self.folder(trainer), step)

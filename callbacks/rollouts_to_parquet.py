"""Write every training generation batch to Parquet, for analysis after (or during) the run."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl


class RolloutsToParquet(pl.Callback):
    """One Parquet file per generation batch (all ranks' rows, written by rank 0) in ``dirpath``:
    ``step`` (the optimizer step whose policy generated it), ``prompt``, ``completion``, one
    ``reward/<func>`` column per reward function, ``advantage``, and the reward functions'
    ``log_extra`` columns. Read the folder as one table::

        import pandas as pd
        rollouts = pd.read_parquet("runs/quickstart/rollouts")

    Args:
        dirpath: Output folder (default ``<trainer.default_root_dir>/rollouts``).
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.files_written = 0
        self._last_table: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            import pyarrow  # noqa: F401
        except ImportError as error:
            raise ImportError("RolloutsToParquet writes Parquet with pyarrow: pip install pyarrow") from error
        trainer.datamodule.collect_completions = True  # gather each batch's texts into completion_table

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        table = trainer.datamodule.completion_table  # the latest generation batch (a new object per batch)
        if table is None or table is self._last_table:
            return
        self._last_table = table
        if trainer.is_global_zero:
            import pyarrow as pa
            import pyarrow.parquet as pq

            folder = self.dirpath or os.path.join(trainer.default_root_dir, "rollouts")
            os.makedirs(folder, exist_ok=True)
            columns = {"step": [table.step] * len(table), **table.columns}
            name = f"rollouts_{self.files_written:06d}_step{table.step:06d}.parquet"
            pq.write_table(pa.Table.from_pydict(columns), os.path.join(folder, name))
        self.files_written += 1

    def state_dict(self) -> dict[str, Any]:
        return {"files_written": self.files_written}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.files_written = state_dict["files_written"]

"""Keep the policy with the best evaluation metric seen so far, ready for ``from_pretrained``."""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any, Literal

import lightning.pytorch as pl


class SaveBestPolicy(pl.Callback):
    """After each evaluation, exports the policy (``pl_module.export``: ``save_pretrained`` of the
    model and tokenizer) when ``monitor`` improved; only the best one is kept, with ``best.json``
    (``{"step", "value", "monitor"}``) beside it.

    Needs evaluation: ``data.eval_dataset`` and ``trainer.val_check_interval`` (or
    ``check_val_every_n_epoch``).

    Args:
        monitor: An evaluation metric by name (``eval_reward``, ``eval_rewards/<func>/mean``, ...).
        mode: ``max`` (higher is better) or ``min``.
        dirpath: Where the best policy goes (default ``<trainer.default_root_dir>/best_model``).
    """

    def __init__(self, monitor: str = "eval_reward", mode: Literal["max", "min"] = "max",
                 dirpath: str | None = None) -> None:
        self.monitor, self.mode, self.dirpath = monitor, mode, dirpath
        self.best_value = -math.inf if mode == "max" else math.inf
        self.best_step: int | None = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self.monitor not in trainer.callback_metrics:
            raise KeyError(f"SaveBestPolicy.monitor={self.monitor!r} was not logged by the evaluation; "
                           f"choose one of {sorted(k for k in trainer.callback_metrics if k.startswith('eval'))}")
        value = float(trainer.callback_metrics[self.monitor])
        better = value > self.best_value if self.mode == "max" else value < self.best_value
        if not trainer.strategy.broadcast(better, src=0):  # every rank takes the same decision
            return
        self.best_value, self.best_step = value, trainer.global_step
        target = self.dirpath or os.path.join(trainer.default_root_dir, "best_model")
        partial = target + ".partial"
        if trainer.is_global_zero:
            shutil.rmtree(partial, ignore_errors=True)  # left by a run stopped while exporting
        pl_module.export(partial)  # collective under sharding: every rank calls it, rank 0 writes
        if trainer.is_global_zero:
            with open(os.path.join(partial, "best.json"), "w") as f:
                json.dump({"step": self.best_step, "value": value, "monitor": self.monitor}, f)
            shutil.rmtree(target, ignore_errors=True)  # the previous best
            os.replace(partial, target)
        trainer.strategy.barrier()

    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value, "best_step": self.best_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_value, self.best_step = state_dict["best_value"], state_dict["best_step"]

"""Stop training once the mean reward of the last few optimizer steps reaches a threshold."""

from __future__ import annotations

from collections import deque
from typing import Any

import lightning.pytorch as pl


class StopWhenRewardReached(pl.Callback):
    """Stops the run after the first optimizer step at which the mean of ``metric`` over the last
    ``window`` steps is at least ``threshold`` (the final model is still exported).

    Args:
        threshold: Stop when the windowed mean reaches this value.
        window: Number of optimizer steps averaged; no stop before that many steps.
        metric: Any step metric by its TRL name (``reward``, ``rewards/<func>/mean``, ...).
    """

    def __init__(self, threshold: float, window: int = 10, metric: str = "reward") -> None:
        if window < 1:
            raise ValueError(f"StopWhenRewardReached.window={window}: use a positive number of steps.")
        self.threshold, self.window, self.metric = threshold, window, metric
        self.recent: deque[float] = deque(maxlen=window)
        self.stopped_at_step: int | None = None
        self._last_step = -1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # a micro-batch inside an accumulated step
            return
        self._last_step = trainer.global_step
        metrics = pl_module.step_metrics  # the metrics of the optimizer step that just finished
        if self.metric not in metrics:
            raise KeyError(f"StopWhenRewardReached.metric={self.metric!r} is not a step metric; "
                           f"choose one of {sorted(metrics)}")
        self.recent.append(float(metrics[self.metric]))
        reached = len(self.recent) == self.window and sum(self.recent) / self.window >= self.threshold
        # Every rank must stop at the same step (the metrics are global, so they agree anyway).
        if trainer.strategy.reduce_boolean_decision(reached, all=False):
            trainer.should_stop = True
            self.stopped_at_step = trainer.global_step

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "last_step": self._last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.recent = deque(state_dict["recent"], maxlen=self.window)
        self._last_step = state_dict["last_step"]

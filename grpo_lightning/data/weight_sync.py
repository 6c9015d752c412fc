"""``WeightSync``: pushes the policy into samplers that keep their own copy of the weights.

Part of the data side because it serves the sampler the datamodule owns; ``RolloutDataModule``
adds it to the trainer by itself when its sampler ``keeps_own_weights`` (vLLM, a remote server),
and it is public as ``grpo_lightning.callbacks.WeightSync``.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

log = logging.getLogger(__name__)


class WeightSync(pl.Callback):
    """After every optimizer step (and when training or validation starts, e.g. after a resume),
    hand the current policy to ``trainer.datamodule.sampler.on_policy_updated(pl_module, step)``.

    The push runs inside ``pl_module.generation_context()`` so sharded weights are whole. The
    sampler verifies what its engine serves and raises on a failed push; the rollout builder
    refuses to generate from a sampler that does not serve the current step.
    """

    def __init__(self) -> None:
        self.pushed_version: int | None = None

    def _push(self, trainer: pl.Trainer, pl_module: Any) -> None:
        version = trainer.global_step
        if version == self.pushed_version:
            return
        sampler = trainer.datamodule.sampler
        with pl_module.generation_context():
            sampler.on_policy_updated(pl_module, version)
        self.pushed_version = version
        log.debug("Pushed policy version %d to %s", version, type(sampler).__name__)

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._push(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._push(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._push(trainer, pl_module)  # a no-op while the step is still accumulating

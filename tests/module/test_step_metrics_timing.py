"""A step's metrics are read once its update is queued (on a GPU the host's reads and bookkeeping
then overlap the update instead of holding it back), yet they are what they were: ``grad_norm`` is
the pre-clipping norm the clipping used, ``step_time`` ends before the optimizer (TRL's), and
``learning_rate`` is the rate the step applied."""

from __future__ import annotations

import math
import time

import lightning.pytorch as pl
import torch

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts

UPDATE_SECONDS = 0.5  # well above a tiny step's own time, so a step_time that counted the update would show


class Watch(pl.Callback):
    """Makes each update take UPDATE_SECONDS and records, in order, the updates, the module's metric
    publications, the norm of the gradients the clipping saw, and what callbacks read."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.norms_before_clipping: list[float] = []
        self.lr_applied: list[float] = []
        self.metrics: list[dict[str, float]] = []
        self.step_walls: list[float] = []  # from the previous step's end (or the start) to this one's

    def on_train_start(self, trainer, pl_module):
        self._last_end = time.perf_counter()
        optimizer = trainer.optimizers[0]
        step = optimizer.step

        def slow_step(closure=None):
            loss = closure() if closure is not None else None  # Lightning's: forward, backward, norm, clipping
            self.events.append("update")
            time.sleep(UPDATE_SECONDS)
            step()
            return loss

        optimizer.step = slow_step
        publish = pl_module._publish_step_metrics

        def recorded_publish(opt):
            self.events.append("publish")
            publish(opt)

        pl_module._publish_step_metrics = recorded_publish

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # runs before the module's
        grads = [p.grad.double() for p in pl_module.policy.parameters() if p.grad is not None]
        self.norms_before_clipping.append(float(torch.cat([g.flatten() for g in grads]).norm()))
        self.lr_applied.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append(dict(pl_module.step_metrics))
        now = time.perf_counter()
        self.step_walls.append(now - self._last_end)
        self._last_end = now


def test_metrics_are_read_after_the_update_and_keep_their_meaning(tmp_path):
    pl.seed_everything(3, verbose=False)
    watch = Watch()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, gradient_clip_val=1e-3,
                         default_root_dir=tmp_path / "run", callbacks=[watch])
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    module = GRPOModule(make_model_dir(tmp_path / "m"), learning_rate=1e-2, warmup_steps=2, save_final_model=False)
    trainer.fit(module, data)

    assert watch.events == ["update", "publish"] * 3  # each step's metrics after its update, none before
    assert len(watch.metrics) == 3
    for metrics, norm, lr, wall in zip(watch.metrics, watch.norms_before_clipping, watch.lr_applied, watch.step_walls):
        assert math.isclose(metrics["grad_norm"], norm, rel_tol=1e-5)  # float32 accumulation vs a float64 norm
        assert norm > 1e-3  # so the step was clipped: the norm is the one before clipping
        assert metrics["learning_rate"] == lr  # read before the scheduler steps
        assert 0 < metrics["step_time"] <= wall - UPDATE_SECONDS  # TRL's: generation and micro-steps, not the update
    assert watch.lr_applied == [0.0, 5e-3, 1e-2]  # warm-up: the rates differ step to step

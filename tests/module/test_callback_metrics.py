"""A step's metrics reach Lightning's callbacks and progress bar (module/callback_metrics.py)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


class RecordMetrics(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[dict, dict, dict]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((dict(trainer.callback_metrics), dict(trainer.progress_bar_metrics), dict(pl_module.step_metrics)))


def test_step_metrics_feed_checkpoint_early_stopping_and_the_progress_bar(tmp_path):
    record = RecordMetrics()
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="reward", mode="max", save_top_k=1,
                           every_n_train_steps=1, filename="{step}-{reward:.3f}")
    stop = EarlyStopping(monitor="grad_norm", mode="min", patience=100, check_on_train_epoch_end=True)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=True,
                         enable_model_summary=False, callbacks=[record, best, stop], default_root_dir=tmp_path)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    trainer.fit(GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False), data)

    assert len(record.seen) == 3
    for callback, bar, step in record.seen:  # this step's values, as Lightning's self.log leaves them
        assert set(step) <= set(callback) and {"reward", "loss", "grad_norm"} <= set(step)
        for name, value in step.items():
            assert isinstance(callback[name], torch.Tensor) and callback[name].ndim == 0
            assert torch.equal(callback[name], torch.tensor(value)) or math.isnan(value) and callback[name].isnan()
        assert bar["reward"] == step["reward"] and bar["loss"] == step["loss"]
    as_logged = lambda name: [torch.tensor(step[name]) for _, _, step in record.seen]  # noqa: E731 (float32)
    assert best.best_model_score == max(as_logged("reward"))  # ModelCheckpoint read "reward" every step
    assert f"reward={float(max(as_logged('reward'))):.3f}" in best.best_model_path
    assert stop.best_score == as_logged("grad_norm")[-1]  # EarlyStopping read "grad_norm" at the epoch's end

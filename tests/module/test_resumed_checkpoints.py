"""A run resumed inside gradient accumulation does not overwrite the checkpoint it resumed from."""

from __future__ import annotations

import hashlib

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


def _fit(tmp_path, max_steps, ckpt_path=None):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=2, callbacks=[checkpoint])
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=4, seed=3, generation=GenerationParams(max_completion_length=4))
    module = GRPOModule(make_model_dir(tmp_path / "m"), learning_rate=1e-2, save_final_model=False)
    trainer.fit(module, data, ckpt_path=ckpt_path)


def test_the_resumed_step_is_not_saved_again_inside_the_next_window(tmp_path):
    _fit(tmp_path, max_steps=2)
    resumed_from = tmp_path / "ckpt" / "step=2.ckpt"
    before = hashlib.sha256(resumed_from.read_bytes()).hexdigest()
    step = torch.load(resumed_from, weights_only=False)["global_step"]
    _fit(tmp_path, max_steps=3, ckpt_path=str(resumed_from))
    # Lightning would re-save step=2 at the first micro-step of window 3 (global_step still 2)
    assert hashlib.sha256(resumed_from.read_bytes()).hexdigest() == before
    assert torch.load(resumed_from, weights_only=False)["global_step"] == step == 2
    assert (tmp_path / "ckpt" / "step=3.ckpt").is_file()


def test_only_periodic_checkpoints_are_marked_saved_at_the_restored_step():
    """A ``ModelCheckpoint`` that saves on a validation's end (a monitored ``eval_*`` metric, no
    ``every_n_train_steps``) still saves a validation of the restored step."""
    from types import SimpleNamespace

    from grpo_lightning.module.resumed_checkpoints import ResumedCheckpoints

    periodic = ModelCheckpoint(every_n_train_steps=5)
    best = ModelCheckpoint(monitor="eval_reward", mode="max")
    ResumedCheckpoints().on_train_start(SimpleNamespace(global_step=10, checkpoint_callbacks=[periodic, best]), None)
    assert (periodic._last_global_step_saved, best._last_global_step_saved) == (10, 0)

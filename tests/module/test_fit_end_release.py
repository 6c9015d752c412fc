"""A finished fit drops its last gradients and, unless kept, its optimizer state before Lightning's
teardown copies them to the host; a checkpoint after that is refused, checkpoints during fit
(and ``save_last`` at the end of training) keep the whole state."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.errors import ConfigError
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.fit_end_release import drop_gradients, drop_optimizer_states
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


def _fit(tmp_path, callbacks=(), **module_kwargs):
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path / "run", callbacks=list(callbacks))
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    module = GRPOModule(make_model_dir(tmp_path / "m"), learning_rate=1e-2, save_final_model=False, **module_kwargs)
    trainer.fit(module, data)
    return trainer, module


def _adam_moments(optimizer_state: dict) -> list[torch.Tensor]:
    return [t for per_param in optimizer_state["state"].values() for k, t in per_param.items() if k != "step"]


def test_the_byte_counts_are_the_tensors_held():
    weights = [torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(7, dtype=torch.float64))]
    optimizer = torch.optim.AdamW(weights)
    sum(w.sum() for w in weights).backward()
    optimizer.step()
    assert drop_optimizer_states([optimizer, object()]) == (1, 2 * (15 * 4 + 7 * 8))  # exp_avg, exp_avg_sq
    assert not optimizer.state and optimizer.param_groups[0]["lr"] == 1e-3
    assert drop_gradients(weights) == 15 * 4 + 7 * 8 and all(w.grad is None for w in weights)


def test_a_finished_fit_holds_no_gradients_or_optimizer_state_and_refuses_a_late_checkpoint(tmp_path):
    during = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer, module = _fit(tmp_path, [during])
    assert all(p.grad is None for p in module.parameters())
    assert module.optimizer_state_released and not trainer.optimizers[0].state
    with pytest.raises(ConfigError, match="model.keep_optimizer_state_after_fit: true"):
        trainer.save_checkpoint(tmp_path / "late.ckpt")
    assert not (tmp_path / "late.ckpt").exists()

    # The checkpoint written at the last step, during fit, has every moment: the run resumes exactly.
    (ckpt,) = (tmp_path / "ckpt").glob("*.ckpt")
    state = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    trainable = sum(1 for p in module.parameters() if p.requires_grad)
    assert len(state["state"]) == trainable
    assert all(t.abs().sum() > 0 for t in _adam_moments(state)[1::2])  # every exp_avg_sq was updated


def test_save_last_at_the_end_of_training_still_has_the_optimizer_state(tmp_path):
    last = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1000, save_last=True, save_top_k=0)
    _fit(tmp_path, [last])
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["optimizer_states"][0]
    assert state["state"] and all(t.abs().sum() > 0 for t in _adam_moments(state)[1::2])


def test_keep_optimizer_state_after_fit_allows_an_exact_checkpoint_after_fit(tmp_path):
    trainer, module = _fit(tmp_path, keep_optimizer_state_after_fit=True)
    assert not module.optimizer_state_released
    kept = {k: v.clone() for k, v in trainer.optimizers[0].state[next(iter(trainer.optimizers[0].state))].items()}
    assert all(p.grad is None for p in module.parameters())  # the gradients are dropped either way
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    saved = torch.load(tmp_path / "after.ckpt", weights_only=False)["optimizer_states"][0]["state"][0]
    assert saved.keys() == kept.keys() and all(torch.equal(saved[k], kept[k]) for k in kept)

"""``final_model`` is written once per finished fit, also by a fit resumed at ``max_steps``."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


def _fit(tmp_path, root, *, save_final_model, ckpt_path=None):
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1)])
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    module = GRPOModule(make_model_dir(tmp_path / "m"), learning_rate=1e-2, save_final_model=save_final_model)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, module


def test_a_fit_resumed_at_max_steps_exports_the_checkpoint_weights(tmp_path):
    first, trained = _fit(tmp_path, tmp_path / "run", save_final_model=False)  # "killed" before its export
    (ckpt,) = (tmp_path / "run" / "ckpt").glob("*.ckpt")
    assert not (tmp_path / "run" / "final_model").exists()

    resumed, module = _fit(tmp_path, tmp_path / "run", save_final_model=True, ckpt_path=str(ckpt))
    assert resumed.global_step == 2  # no step was trained again
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model")
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    for name, value in exported.state_dict().items():
        assert torch.equal(value, state[f"policy.{name}"]), name


def test_a_normal_fit_exports_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(GRPOModule, "export", lambda self, directory: calls.append(directory))
    _fit(tmp_path, tmp_path / "run", save_final_model=True)
    assert calls == [str(tmp_path / "run" / "final_model")]

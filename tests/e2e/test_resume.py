"""A run resumed from a checkpoint continues with the same prompt order."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


class RecordPrompts(pl.Callback):
    def __init__(self) -> None:
        self.prompts: dict[int, list[list[int]]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch.prompt_ids, batch.prompt_mask)]
        self.prompts[trainer.global_step] = sorted(rows)


def run(model_dir, prompts, root, max_steps, ckpt_path=None):
    recorder = RecordPrompts()
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root), callbacks=[recorder, checkpoint],
    )
    module = GRPOModule(model_dir, learning_rate=1e-2, save_final_model=False)
    data = RolloutDataModule(
        prompts, reward_funcs=[length_reward], num_generations=4, per_device_train_batch_size=8,
        generation=GenerationParams(max_completion_length=4),
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return recorder.prompts, data


@pytest.mark.slow
def test_resume_continues_the_prompt_order(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    prompts = write_prompts(tmp_path / "prompts.jsonl", num_rows=10)  # 5 generations per epoch
    straight, _ = run(model_dir, prompts, tmp_path / "a", max_steps=7)
    first, _ = run(model_dir, prompts, tmp_path / "b", max_steps=3)
    resumed, data = run(model_dir, prompts, tmp_path / "b", max_steps=7, ckpt_path=str(tmp_path / "b/ckpt/epoch=0-step=3.ckpt"))
    assert sorted(resumed) == [3, 4, 5, 6]  # crosses an epoch boundary at step 5
    for step in range(7):
        assert (first if step < 3 else resumed)[step] == straight[step], f"prompts differ at step {step}"
    assert data.micro_steps_done == 7

"""A tiny Qwen2-VL trained through the Lightning Trainer on a dataset with an image column."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward
from tests.vlm.tiny_vlm import color_image, qwen2_vl_model

SIZES = [(40, 36), (60, 30), (30, 60), (56, 56)]


def write_image_prompts(folder, num_rows=4, sizes=SIZES):
    """A jsonl dataset: a conversational prompt and an image path per row (image ``i`` of size
    ``sizes[i % len(sizes)]``)."""
    path = folder / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(num_rows):
            image = folder / f"{i}.png"
            color_image(i, sizes[i % len(sizes)]).save(image)
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"How many dots? {i}"}],
                                "image": str(image), "answer": str(i)}) + "\n")
    return str(path)


class RecordBatches(pl.Callback):
    def __init__(self):
        self.grids = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        assert batch.model_inputs is not None and len(batch.model_inputs) == len(batch)
        self.grids.append([g.tolist() for g in batch.model_inputs.rows.get("image_grid_thw", [])])  # Qwen-VL


def fit(tmp_path, processor, *, model=None, max_steps=2, module_kwargs=None, callbacks=(), logger=False, sizes=SIZES,
        **data_kwargs):
    """Trains ``model`` (default: a tiny Qwen2-VL) on 4 image prompts (of ``sizes``); ``(module,
    trainer, weights before, recorded image grids)``."""
    model = model if model is not None else qwen2_vl_model(processor.tokenizer)
    settings = {"learning_rate": 1e-2, "lr_scheduler_type": "constant", "gradient_checkpointing": False,
                **(module_kwargs or {})}
    module = GRPOModule(model, tokenizer=processor, **settings)
    datamodule = RolloutDataModule(
        write_image_prompts(tmp_path, sizes=sizes), reward_funcs=[length_reward], num_generations=2,
        per_device_train_batch_size=4, generation=GenerationParams(max_completion_length=4), **data_kwargs,
    )
    recorder = RecordBatches()
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[recorder, *callbacks], log_every_n_steps=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.fit(module, datamodule)
    return module, trainer, before, recorder


def changed_parameters(module, before) -> set[str]:
    return {n for n, p in module.policy.named_parameters() if not torch.equal(p, before[n])}


@pytest.mark.slow
def test_two_optimizer_steps_train_a_tiny_qwen2_vl(tmp_path, qwen_processor):
    module, trainer, before, recorder = fit(tmp_path, qwen_processor)
    assert trainer.global_step == 2
    changed = changed_parameters(module, before)
    assert any("visual" in n for n in changed), "the vision tower got no update: the images did not reach the loss"
    assert any("language_model" in n for n in changed)
    # Each micro-batch: 4 rows (2 prompts x 2 completions), each with its own image grid.
    assert all(len(grids) == 4 for grids in recorder.grids)


@pytest.mark.slow
def test_replay_reference_and_token_budgets_train_with_the_images(tmp_path, qwen_processor):
    """num_iterations=2 replays each generation batch (old log-probs: an optimizer step falls
    between generating and training), beta != 0 adds the reference pass, and the token budgets
    split the no-grad and training passes: each sees its rows' images."""
    from grpo_lightning.losses import DAPOLoss
    from grpo_lightning.module.forward_options import ForwardOptions

    forward = ForwardOptions(logprob_token_budget=64, train_token_budget=64)
    module, trainer, before, recorder = fit(
        tmp_path, qwen_processor, max_steps=4, num_iterations=2, steps_per_generation=2,
        module_kwargs={"loss": DAPOLoss(beta=0.04), "forward": forward},
    )
    assert trainer.global_step == 4
    assert module.ref_policy is not None
    assert all(len(grids) == 4 for grids in recorder.grids)  # 4 prompts x 2 completions in 2 micro-batches
    # A replayed micro-batch holds the same rows (same grids), reshuffled within the generation batch.
    assert sorted(map(str, recorder.grids[0] + recorder.grids[1])) == sorted(map(str, recorder.grids[2] + recorder.grids[3]))

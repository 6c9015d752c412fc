"""Token-normalised losses give the same update whatever the accumulation split.

The same generation batch (8 completions, same seed, so the same samples) is trained either as one
micro-batch of 8 or as 2 accumulated micro-batches of 4. Lightning divides each micro-step's loss
by ``accumulate_grad_batches``; the module compensates, so one SGD step must give the same weights
(to float32 rounding: ``tests/e2e/same_step.py``).
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.e2e.same_step import assert_same_sgd_step
from tests.helpers import length_reward, make_model_dir, write_prompts, built


def one_step(model_dir, prompts, loss, accumulate, tmp_path):
    pl.seed_everything(7)
    module = GRPOModule(model_dir, loss=loss, optimizer=functools.partial(torch.optim.SGD, lr=1.0),
                        lr_scheduler_type="constant", save_final_model=False)
    data = RolloutDataModule(prompts, reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8 // accumulate, steps_per_generation=accumulate,
                             generation=GenerationParams(max_completion_length=6))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accumulate_grad_batches=accumulate,
                         default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    return [p.detach().clone() for p in module.policy.parameters()], data


def completions(data) -> list[tuple[int, ...]]:
    """Every completion of the buffered generation batch, padding removed, in a canonical order."""
    rows = []
    for batch in data.buffer.batches:
        rows += [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(batch.completion_ids, batch.completion_mask)]
    return sorted(rows)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dapo", "grpo", "dr_grpo"])
def test_one_micro_batch_equals_two_accumulated(tmp_path, loss):
    model_dir = make_model_dir(tmp_path / "m")
    prompts = write_prompts(tmp_path / "p.jsonl")
    initial = [p.detach().clone() for p in built(GRPOModule(model_dir)).policy.parameters()]
    whole, data_whole = one_step(model_dir, prompts, loss, 1, tmp_path)
    split, data_split = one_step(model_dir, prompts, loss, 2, tmp_path)
    assert len(data_whole.buffer.batches) == 1 and len(data_split.buffer.batches) == 2
    assert completions(data_whole) == completions(data_split), "the two runs must train on the same samples"
    moved = sum(float((w - i).abs().sum()) for w, i in zip(whole, initial))
    assert moved > 1e-3, "the step did not move the weights: the comparison would be vacuous"
    from transformers import AutoModelForCausalLM

    batches = data_whole.buffer.batches
    width = max(b.prompt_ids.shape[1] + b.completion_ids.shape[1] for b in batches)
    tokens = sum(int(b.completion_mask.sum()) for b in batches)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert_same_sgd_step(split, whole, initial, model, width=width, tokens=tokens, temperature=batches[0].temperature)

"""The recipe's architecture, Qwen2.5-VL (windowed vision attention), tiny: the training pass
equals each row alone, the no-grad pass equals the training pass, and two optimizer steps train."""

from __future__ import annotations

from contextlib import nullcontext

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.forward import completion_logprobs
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.module.model_loading import load_tokenizer
from grpo_lightning.module.training_forward import rows_logprobs
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward
from tests.vlm.test_vlm_forward import ATOL, _batch, _prompts, _reference
from tests.vlm.test_vlm_training import write_image_prompts
from tests.vlm.tiny_vlm import qwen2_5_vl_model, qwen2_5_vl_processor


@pytest.fixture(scope="module")
def processor(shared_assets):
    return qwen2_5_vl_processor(shared_assets / "tokenizers" / "qwen2.5")


def test_qwen2_5_vl_training_and_no_grad_passes_match_each_row_alone(processor):
    tokenizer = load_tokenizer(processor)
    model = qwen2_5_vl_model(tokenizer).double().eval()
    prompts = _prompts(tokenizer)
    batch = _batch(prompts, tokenizer)
    with torch.no_grad():
        expected = _reference(model, prompts, batch)
        old = rows_logprobs(model, batch, 2, ForwardOptions(), nullcontext)
    logps, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask, batch.temperature, model_inputs=batch.model_inputs)
    assert logps.requires_grad
    for row, ref in enumerate(expected):
        mask = batch.completion_mask[row].bool()
        torch.testing.assert_close(logps[row][mask].double(), ref, rtol=0, atol=ATOL)
        torch.testing.assert_close(old[row][mask], logps[row][mask].detach(), rtol=0, atol=ATOL)


@pytest.mark.slow
def test_two_optimizer_steps_train_a_tiny_qwen2_5_vl(tmp_path, processor):
    model = qwen2_5_vl_model(processor.tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = GRPOModule(model, tokenizer=processor, learning_rate=1e-2, lr_scheduler_type="constant",
                        gradient_checkpointing=True, save_final_model=False)
    datamodule = RolloutDataModule(write_image_prompts(tmp_path), reward_funcs=[length_reward], num_generations=2,
                                   per_device_train_batch_size=4, generation=GenerationParams(max_completion_length=4))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule)
    assert trainer.global_step == 2
    changed = {n for n, p in module.policy.named_parameters() if not torch.equal(p, before[n])}
    assert any("visual" in n for n in changed) and any("language_model" in n for n in changed)

"""The recipe's architecture, Qwen2.5-VL (windowed vision attention), tiny: the training pass
equals each row alone, the no-grad pass equals the training pass, and two optimizer steps train."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from grpo_lightning.module.forward import completion_logprobs
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.module.model_loading import load_tokenizer
from grpo_lightning.module.training_forward import rows_logprobs
from tests.vlm.test_vlm_forward import ATOL, _batch, _prompts, _reference
from tests.vlm.test_vlm_training import changed_parameters, fit
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
    module, trainer, before, _ = fit(tmp_path, processor, model=qwen2_5_vl_model(processor.tokenizer),
                                     module_kwargs={"gradient_checkpointing": True, "save_final_model": False})
    assert trainer.global_step == 2
    changed = changed_parameters(module, before)
    assert any("visual" in n for n in changed) and any("language_model" in n for n in changed)

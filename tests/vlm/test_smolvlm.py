"""A SmolVLM/Idefics3-style model: batch-first pixel inputs, rows with different image counts."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.data.collate import pad_sequences, shuffle_and_split
from grpo_lightning.data.multimodal import attach_model_inputs, encode_row_prompt, row_inputs_of
from grpo_lightning.module.forward import completion_logprobs
from grpo_lightning.module.model_loading import load_tokenizer
from grpo_lightning.types import Rollout, RolloutBatch
from tests.vlm.test_vlm_forward import _alone
from tests.vlm.test_vlm_training import changed_parameters, fit
from tests.vlm.tiny_vlm import color_image, idefics3_model

ATOL = 4e-6  # float64 model, float32 log-probs (|logp| ~ 12)


def _setup(processor):
    tokenizer = load_tokenizer(processor)
    images = [[color_image(0)], [color_image(1), color_image(2, (50, 20))], [color_image(3, (20, 44))]]
    prompts = [encode_row_prompt({"prompt": [{"role": "user", "content": f"count {i}"}], "images": imgs}, i, tokenizer)
               for i, imgs in enumerate(images)]
    g = torch.Generator().manual_seed(0)
    rollouts = [Rollout(list(p), torch.randint(0, 1000, (n,), generator=g).tolist(), True, 0)
                for p, n in zip(prompts, [3, 5, 2])]
    attach_model_inputs(rollouts, prompts, 1)
    prompt_ids, prompt_mask = pad_sequences([r.prompt_ids for r in rollouts], value=tokenizer.pad_token_id, side="left")
    completion_ids, completion_mask = pad_sequences([r.completion_ids for r in rollouts], value=0, side="right")
    batch = RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(3), torch.tensor(0.0),
                         torch.zeros(3, dtype=torch.long), model_inputs=row_inputs_of(rollouts))
    return tokenizer, prompts, batch


def test_rows_with_different_image_counts_score_as_alone(idefics3_processor):
    tokenizer, prompts, batch = _setup(idefics3_processor)
    assert [p.model_inputs["pixel_values"].shape[1] for p in prompts] == [1, 2, 1]
    collated = batch.model_inputs.collate(batch.prompt_ids.shape[1])
    assert collated["pixel_values"].shape == (3, 2, 3, 32, 32)  # rows with one image padded with a zero image
    assert collated["pixel_values"][0, 1].abs().sum() == 0 and collated["pixel_attention_mask"][2, 1].sum() == 0
    model = idefics3_model(tokenizer).double().eval()
    logps, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask, 1.0, model_inputs=batch.model_inputs)
    for row in range(3):
        completion = batch.completion_ids[row][batch.completion_mask[row].bool()]
        with torch.no_grad():
            expected = _alone(model, prompts[row], completion)
        got = logps[row][batch.completion_mask[row].bool()].double()
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    for chunk in shuffle_and_split(batch, 3, torch.Generator().manual_seed(1)):  # one row each, its own images
        with torch.no_grad():
            logp, _ = completion_logprobs(model, chunk.prompt_ids, chunk.prompt_mask, chunk.completion_ids,
                                          chunk.completion_mask, 1.0, model_inputs=chunk.model_inputs)
        row = next(i for i in range(3) if batch.completion_ids[i, 0] == chunk.completion_ids[0, 0])
        torch.testing.assert_close(logp[0][chunk.completion_mask[0].bool()], logps[row][batch.completion_mask[row].bool()]
                                   .detach(), rtol=0, atol=ATOL)


def test_a_text_prompt_needs_one_image_token_per_image(idefics3_processor):
    tokenizer = load_tokenizer(idefics3_processor)
    with pytest.raises(ValueError, match="dataset row 4: its text prompt holds 1 image token.*'<image>' but the row has 2"):
        encode_row_prompt({"prompt": "<image> count", "images": [color_image(0), color_image(1)]}, 4, tokenizer)
    prompt = encode_row_prompt({"prompt": "<image><image> count", "images": [color_image(0), color_image(1)]}, 4,
                               tokenizer)
    assert prompt.model_inputs["pixel_values"].shape[:2] == (1, 2)


@pytest.mark.slow
def test_two_optimizer_steps_train_a_tiny_idefics3(tmp_path, idefics3_processor):
    model = idefics3_model(load_tokenizer(idefics3_processor))
    module, trainer, before, _ = fit(tmp_path, idefics3_processor, model=model,
                                     module_kwargs={"save_final_model": False})
    assert trainer.global_step == 2
    changed = changed_parameters(module, before)
    assert any("vision_model" in n for n in changed) and any("text_model" in n for n in changed)


def test_a_processor_folder_loads_as_the_processing_class(tmp_path, idefics3_processor):
    """model.tokenizer pointing at a folder with preprocessor_config.json loads with AutoProcessor."""
    from grpo_lightning.module.model_loading import check_model_sources, is_processor_folder

    idefics3_processor.save_pretrained(tmp_path / "processor")
    folder = str(tmp_path / "processor")
    assert is_processor_folder(folder)
    check_model_sources("unused/model", folder)
    tokenizer = load_tokenizer(folder)
    assert type(tokenizer.processor).__name__ == "Idefics3Processor"
    assert tokenizer.pad_token_id is not None and tokenizer.chat_template is not None
    prompt = encode_row_prompt({"prompt": [{"role": "user", "content": "hi"}], "image": color_image(0)}, 0, tokenizer)
    expected = encode_row_prompt({"prompt": [{"role": "user", "content": "hi"}], "image": color_image(0)}, 0,
                                 load_tokenizer(idefics3_processor))
    assert list(prompt) == list(expected)
    assert torch.equal(prompt.model_inputs["pixel_values"], expected.model_inputs["pixel_values"])

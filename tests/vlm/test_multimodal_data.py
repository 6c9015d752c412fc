"""Image rows → processor → ids plus per-row inputs that stay aligned with their rows."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.data.collate import shuffle_and_split
from grpo_lightning.data.multimodal import (
    MultimodalPrompt, attach_model_inputs, encode_row_prompt, multimodal_messages, row_inputs_of,
)
from grpo_lightning.module.model_loading import load_tokenizer
from grpo_lightning.types import Rollout, RolloutBatch
from tests.vlm.tiny_vlm import color_image

# Image sizes giving 1x(2x2), 1x(2x4) and 1x(4x2) patch grids: 4, 8 and 8 flattened patches.
SIZES = [(40, 36), (60, 30), (30, 60)]


def chat(text="What color is it?"):
    return [{"role": "user", "content": text}]


@pytest.fixture
def tokenizer(qwen_processor):
    return load_tokenizer(qwen_processor)


def test_load_tokenizer_of_a_processor_keeps_the_processor(qwen_processor, tokenizer):
    assert tokenizer is qwen_processor.tokenizer and tokenizer.processor is qwen_processor
    assert tokenizer.pad_token_id is not None and tokenizer.padding_side == "left"


def test_a_row_with_an_image_is_encoded_by_the_processor(qwen_processor, tokenizer):
    image = color_image(0, SIZES[1])
    prompt = encode_row_prompt({"prompt": chat(), "image": image}, 7, tokenizer)
    assert isinstance(prompt, MultimodalPrompt)
    messages = multimodal_messages(chat(), 1, 7)
    text = qwen_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = qwen_processor(text=[text], images=[[image]], return_tensors="pt")
    assert list(prompt) == expected["input_ids"][0].tolist()
    assert torch.equal(prompt.model_inputs["pixel_values"], expected["pixel_values"])  # (8, 1176)
    assert prompt.model_inputs["image_grid_thw"].tolist() == [[1, 2, 4]]
    assert prompt.token_fields == ("mm_token_type_ids",)
    assert torch.equal(prompt.model_inputs["mm_token_type_ids"], expected["mm_token_type_ids"][0])
    # 8 patches merged 2x2: 2 image tokens in the prompt.
    assert list(prompt).count(qwen_processor.image_token_id) == 2


def test_image_paths_and_lists_are_read(tmp_path, tokenizer):
    paths = []
    for i, size in enumerate(SIZES[:2]):
        paths.append(str(tmp_path / f"{i}.png"))
        color_image(i, size).save(paths[-1])
    prompt = encode_row_prompt({"prompt": chat(), "images": paths}, 0, tokenizer)
    assert prompt.model_inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]
    assert prompt.model_inputs["pixel_values"].shape[0] == 12


def test_text_rows_stay_plain_ids(tokenizer):
    ids = encode_row_prompt({"prompt": chat()}, 0, tokenizer)
    assert not isinstance(ids, MultimodalPrompt) and isinstance(ids[0], int)


def test_image_count_mismatch_names_the_row(tokenizer):
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "x"}]}]
    with pytest.raises(ValueError, match="dataset row 5: its prompt has 2 image part.* the row has 1 image"):
        encode_row_prompt({"prompt": prompt, "image": color_image(0)}, 5, tokenizer)
    with pytest.raises(ValueError, match="dataset row 3: its text prompt holds 0 image token"):
        encode_row_prompt({"prompt": "describe", "image": color_image(0)}, 3, tokenizer)


def test_images_without_a_processor_are_refused(qwen_processor):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(qwen_processor.tokenizer.name_or_path)
    with pytest.raises(ValueError, match="dataset row 2 has images but .* plain tokenizer: set model.tokenizer"):
        encode_row_prompt({"prompt": chat(), "image": color_image(0)}, 2, plain)


def _batch(prompts, num_generations, tokenizer):
    """A RolloutBatch of ``num_generations`` completions per prompt, completion i = [i+1]."""
    from grpo_lightning.data.collate import pad_sequences

    rollouts = [Rollout(list(p), [], True, 0) for p in prompts for _ in range(num_generations)]
    for i, r in enumerate(rollouts):
        r.completion_ids = [i + 1]
    attach_model_inputs(rollouts, prompts, num_generations)
    assert rollouts[0].model_inputs is not rollouts[1].model_inputs  # each completion its own record
    prompt_ids, prompt_mask = pad_sequences([r.prompt_ids for r in rollouts], value=tokenizer.pad_token_id, side="left")
    completion_ids, completion_mask = pad_sequences([r.completion_ids for r in rollouts], value=0, side="right")
    n = len(rollouts)
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(n), torch.tensor(0.0),
                        torch.zeros(n, dtype=torch.long), model_inputs=row_inputs_of(rollouts))


def test_every_completion_gets_its_rows_inputs_through_shuffling_and_splitting(tokenizer, qwen_processor):
    prompts = [encode_row_prompt({"prompt": chat(f"q{i}"), "image": color_image(i, s)}, i, tokenizer)
               for i, s in enumerate(SIZES)]
    batch = _batch(prompts, 2, tokenizer)
    assert len(batch.model_inputs) == 6
    chunks = shuffle_and_split(batch, 3, torch.Generator().manual_seed(0))
    seen = []
    for chunk in chunks:
        mm = chunk.model_inputs.collate(chunk.prompt_ids.shape[1], chunk.completion_ids.shape[1])
        offsets = [0, *torch.cumsum(mm["image_grid_thw"].prod(-1), 0).tolist()]
        for row in range(len(chunk)):
            source = (int(chunk.completion_ids[row, 0]) - 1) // 2  # which prompt this completion came from
            seen.append(source)
            expected = prompts[source].model_inputs
            patches = mm["pixel_values"][offsets[row] : offsets[row + 1]]  # Qwen-VL's split by image_grid_thw
            assert torch.equal(patches, expected["pixel_values"])
            assert torch.equal(mm["image_grid_thw"][row : row + 1], expected["image_grid_thw"])
            # Token-aligned fields follow the left-padded prompt and are 0 over the completion.
            width = len(prompts[source])
            tokens = mm["mm_token_type_ids"][row]
            assert torch.equal(tokens[chunk.prompt_ids.shape[1] - width : chunk.prompt_ids.shape[1]],
                               expected["mm_token_type_ids"])
            assert tokens[: chunk.prompt_ids.shape[1] - width].sum() == 0 and tokens[chunk.prompt_ids.shape[1]:].sum() == 0
            real = chunk.prompt_ids[row][chunk.prompt_mask[row].bool()].tolist()
            assert real == list(prompts[source])
    assert sorted(seen) == [0, 0, 1, 1, 2, 2]


def test_a_batch_mixing_image_and_text_rows_is_refused(tokenizer):
    image = encode_row_prompt({"prompt": chat(), "image": color_image(0)}, 0, tokenizer)
    text = encode_row_prompt({"prompt": chat()}, 1, tokenizer)
    rollouts = attach_model_inputs([Rollout(list(p), [1], True, 0) for p in (image, text)], [image, text], 1)
    with pytest.raises(ValueError, match="row 1 of a generation batch has no image"):
        row_inputs_of(rollouts)

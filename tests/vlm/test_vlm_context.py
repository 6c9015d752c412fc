"""A vision-language prompt's image tokens count against the model's context: the check that a
prompt leaves room for ``max_completion_length`` sees the ids the processor expanded, and a
VLM's context comes from its text config (Qwen2-VL's top-level config has none)."""

from __future__ import annotations

import pytest

from grpo_lightning.data.multimodal import encode_row_prompt
from grpo_lightning.module.model_info import read_model_info
from tests.vlm.test_vlm_training import fit
from tests.vlm.tiny_vlm import color_image, qwen2_vl_model, qwen2_vl_processor

IMAGE_SIZE = (224, 224)  # 16x16 patches of 14 pixels, merged 2x2 -> 64 image tokens


@pytest.fixture
def big_image_processor(shared_assets):
    folder = shared_assets / "tokenizers" / "qwen2.5"
    if not folder.is_dir():
        pytest.skip(f"the Qwen2.5 tokenizer asset is missing at {folder}")
    return qwen2_vl_processor(folder, max_pixels=IMAGE_SIZE[0] * IMAGE_SIZE[1])


def test_a_vlm_states_its_context_through_the_text_config(big_image_processor):
    model = qwen2_vl_model(big_image_processor.tokenizer)
    assert not hasattr(model.config, "max_position_embeddings")  # what made the check skip VLMs
    assert read_model_info(model).max_context_length == model.config.text_config.max_position_embeddings


def test_image_tokens_count_against_the_context(tmp_path, big_image_processor):
    tokenizer = big_image_processor.tokenizer
    tokenizer.processor = big_image_processor  # as load_tokenizer attaches it
    def prompt_length(size: tuple[int, int]) -> int:  # the ids the sampler receives
        row = {"prompt": [{"role": "user", "content": "How many dots? 0"}], "image": color_image(0, size)}
        return len(encode_row_prompt(row, 0, tokenizer))

    with_images, small_image = prompt_length(IMAGE_SIZE), prompt_length((28, 28))
    assert with_images >= small_image + 56  # the expansion is what the check must see
    model = qwen2_vl_model(tokenizer)
    model.config.text_config.max_position_embeddings = small_image + 8  # room for the text, not the image
    with pytest.raises(ValueError, match="image tokens included") as err:
        fit(tmp_path, big_image_processor, model=model, sizes=[IMAGE_SIZE])
    assert f"({with_images} tokens, image tokens included)" in str(err.value)
    assert "max_completion_length=4" in str(err.value)

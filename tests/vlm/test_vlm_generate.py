"""HF generate with image prompts: each row generates with its own pixel inputs."""

from __future__ import annotations

import pytest

from grpo_lightning.data.multimodal import check_sampler_images, encode_row_prompt
from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers import HFGenerateSampler
from grpo_lightning.types import GenerationParams
from tests.helpers import built
from tests.vlm.tiny_vlm import color_image

SIZES = [(40, 36), (60, 30), (30, 60)]
GREEDY = GenerationParams(max_completion_length=5, generation_kwargs={"do_sample": False})


@pytest.fixture
def sampler_and_prompts(qwen_processor, qwen_model):
    module = built(GRPOModule(qwen_model.double(), tokenizer=qwen_processor, save_final_model=False))
    sampler = HFGenerateSampler()
    sampler.bind(module)
    prompts = [encode_row_prompt({"prompt": [{"role": "user", "content": "q" * (i + 1)}],
                                  "image": color_image(i, SIZES[i])}, i, module.tokenizer) for i in range(3)]
    return sampler, prompts, module


@pytest.mark.slow
def test_a_batch_of_image_prompts_generates_what_each_prompt_generates_alone(sampler_and_prompts):
    sampler, prompts, _ = sampler_and_prompts
    together = sampler.generate(prompts, 2, GREEDY)  # left-padded, pixel inputs of 6 rows
    alone = [r for p in prompts for r in sampler.generate([p], 2, GREEDY)]
    assert [r.completion_ids for r in together] == [r.completion_ids for r in alone]
    assert [r.prompt_ids for r in together] == [list(p) for p in prompts for _ in range(2)]


def test_the_image_changes_the_completion(sampler_and_prompts):
    sampler, prompts, module = sampler_and_prompts
    others = [encode_row_prompt({"prompt": [{"role": "user", "content": "q" * (i + 1)}],
                                 "image": color_image(10 + i, SIZES[i])}, i, module.tokenizer) for i in range(3)]
    a = [r.completion_ids for r in sampler.generate(prompts, 1, GREEDY)]
    b = [r.completion_ids for r in sampler.generate(others, 1, GREEDY)]
    assert a != b


def test_a_sampler_without_image_support_is_refused(sampler_and_prompts):
    _, prompts, _ = sampler_and_prompts

    class TextOnly:
        pass

    with pytest.raises(ValueError, match="sampler TextOnly does not take image inputs"):
        check_sampler_images(TextOnly(), prompts)
    check_sampler_images(HFGenerateSampler(), prompts)

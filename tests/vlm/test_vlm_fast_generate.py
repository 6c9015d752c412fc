"""fast_generate with image prompts, one tiny model per image layout and position scheme (Qwen2-VL
and Qwen3-VL: M-RoPE; Gemma3, LLaVA-NeXT, Idefics3: 1-D positions): every sampled token's log-prob
is the policy's own on the prompt's ids *and pixels* (a float64 model called once on the whole
sequence), with left-padded prompts of one and two images and rows leaving the batch at different
steps, and the pixels change them."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.data.multimodal import encode_row_prompt
from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers.fast_generate import FastGenerateSampler
from grpo_lightning.types import GenerationParams
from tests.helpers import built
from tests.vlm import tiny_vlm

FAMILIES = ("gemma3", "idefics3", "llava_next", "qwen2_vl", "qwen3_vl")
IMAGES = [[(40, 36)], [(60, 30), (30, 60)], [(64, 64)]]  # per prompt; prompt 1 has two images
# Each token's probability is ~1/151K under these random weights: an EOS bias of 10.5 ends a row
# with probability ~0.2 a step, so rows leave the batch at different steps.
EOS_BIAS = 10.5
ATOL = 4e-6  # float32 log-probs of a float64 model (|logp| ~ 12: float32 spacing ~1e-6)


@pytest.fixture(scope="module", params=FAMILIES)
def policy_and_prompts(request, shared_assets):
    processor = tiny_vlm.asset_processor(request.param, shared_assets)
    model = getattr(tiny_vlm, f"{request.param}_model")(processor.tokenizer).double().eval()
    module = built(GRPOModule(model, tokenizer=processor, save_final_model=False))
    policy = module.policy
    head = torch.nn.Linear(policy.lm_head.in_features, policy.lm_head.out_features, bias=True).double()
    with torch.no_grad():
        head.weight.copy_(policy.lm_head.weight)
        head.bias.zero_()
        head.bias[list(module.eos_token_ids)] = EOS_BIAS
    policy.lm_head = head
    prompts = [encode_row_prompt({"prompt": [{"role": "user", "content": f"what is {i}?"}],
                                  "images": [tiny_vlm.color_image(10 * i + j, size) for j, size in enumerate(sizes)]},
                                 i, module.tokenizer) for i, sizes in enumerate(IMAGES)]
    return module, prompts


def _own_logprobs(policy, prompt, completion, with_pixels=True):
    """The policy's log-probs of ``completion`` after ``prompt``, one unpadded row, float64."""
    ids = torch.tensor([list(prompt) + completion])
    inputs = {}
    if with_pixels:
        n = len(completion)
        for name, value in prompt.model_inputs.items():
            inputs[name] = torch.cat([value, value.new_zeros(n)])[None] if name in prompt.token_fields else value
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[0].double()
    return logits[len(prompt) - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_sampled_log_probs_are_the_policys_own_on_the_ids_and_pixels(policy_and_prompts):
    module, prompts = policy_and_prompts
    sampler = FastGenerateSampler()
    sampler.bind(module)
    torch.manual_seed(0)
    rollouts = sampler.generate(prompts, 3, GenerationParams(max_completion_length=8))
    assert [r.prompt_ids for r in rollouts] == [list(p) for p in prompts for _ in range(3)]
    lengths = [len(r.completion_ids) for r in rollouts]
    assert len(set(lengths)) >= 3 and any(r.ended_on_eos for r in rollouts), lengths  # rows left the batch
    blind_gaps = []
    for i, rollout in enumerate(rollouts):
        prompt = prompts[i // 3]
        want = _own_logprobs(module.policy, prompt, rollout.completion_ids)
        torch.testing.assert_close(torch.tensor(rollout.sampling_logprobs, dtype=torch.float64), want,
                                   rtol=0, atol=ATOL, msg=f"rollout {i}")
        blind = _own_logprobs(module.policy, prompt, rollout.completion_ids, with_pixels=False)
        blind_gaps.append(float((blind - want).abs().max()))
    assert max(blind_gaps) > 1e-3, "the pixels did not change the log-probs: the prefill did not see the images"

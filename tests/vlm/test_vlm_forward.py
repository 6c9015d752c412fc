"""Log-probs of image rows: every pass (training, old/reference no-grad, token budgets) takes the
pixel inputs and gives the log-probs of each row scored alone, unpadded."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

from grpo_lightning.data.collate import pad_sequences
from grpo_lightning.data.multimodal import attach_model_inputs, encode_row_prompt, row_inputs_of
from grpo_lightning.module.forward import completion_logprobs
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.module.model_loading import load_tokenizer
from grpo_lightning.module.training_forward import rows_logprobs
from grpo_lightning.types import Rollout, RolloutBatch
from tests.vlm.tiny_vlm import color_image

SIZES = [(40, 36), (60, 30), (30, 60)]
# The model runs in float64; the log-probs come back in float32 (|logp| ~ 12: float32 spacing
# ~1e-6), so a few float32 ulps is the tolerance.
ATOL = 4e-6
COMPLETION_LENGTHS = [3, 5, 1, 4, 2, 5]  # 2 completions per prompt


def _prompts(tokenizer, seeds=(0, 1, 2)):
    return [encode_row_prompt({"prompt": [{"role": "user", "content": f"what is {i}?"}],
                               "image": color_image(seed, SIZES[i])}, i, tokenizer) for i, seed in enumerate(seeds)]


def _batch(prompts, tokenizer):
    g = torch.Generator().manual_seed(0)
    rollouts = [Rollout(list(p), torch.randint(0, 1000, (n,), generator=g).tolist(), True, 0)
                for p, n in zip([p for p in prompts for _ in range(2)], COMPLETION_LENGTHS)]
    attach_model_inputs(rollouts, prompts, 2)
    prompt_ids, prompt_mask = pad_sequences([r.prompt_ids for r in rollouts], value=tokenizer.pad_token_id, side="left")
    completion_ids, completion_mask = pad_sequences([r.completion_ids for r in rollouts], value=tokenizer.pad_token_id,
                                                    side="right")
    n = len(rollouts)
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(n), torch.tensor(0.0),
                        torch.zeros(n, dtype=torch.long), temperature=0.7, model_inputs=row_inputs_of(rollouts))


def _alone(model, prompt, completion, temperature=1.0):
    """``(C,)`` float64 log-probs of ``completion`` after ``prompt``, unpadded, straight through the
    model with the prompt's processor outputs (token fields extended by zeros over the completion)."""
    ids = torch.cat([torch.tensor(list(prompt)), completion])[None]
    inputs = {name: (torch.cat([value, value.new_zeros(len(completion))])[None] if name in prompt.token_fields
                     else value) for name, value in prompt.model_inputs.items()}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[0].double()
    logits = logits[len(prompt) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(-1, completion[:, None])[:, 0]


def _reference(model, prompts, batch) -> list[torch.Tensor]:
    """Each row alone, unpadded, straight through the model with its processor outputs."""
    return [_alone(model, prompts[row // 2], batch.completion_ids[row][batch.completion_mask[row].bool()],
                   batch.temperature) for row in range(len(batch))]


@pytest.fixture
def setup(qwen_processor, qwen_model):
    tokenizer = load_tokenizer(qwen_processor)
    model = qwen_model.double()
    prompts = _prompts(tokenizer)
    return model, tokenizer, prompts, _batch(prompts, tokenizer)


def _assert_rows_match(logps, expected, batch):
    for row, ref in enumerate(expected):
        got = logps[row][batch.completion_mask[row].bool()].double()
        torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("options", [ForwardOptions(), ForwardOptions.plain(), ForwardOptions(lm_head_chunk_tokens=3)],
                         ids=["chunked_head", "plain", "chunks_of_3"])
def test_training_forward_takes_the_pixel_inputs_and_matches_each_row_alone(setup, options):
    model, _, prompts, batch = setup
    with torch.no_grad():
        expected = _reference(model, prompts, batch)
    model.zero_grad()
    logps, entropies = completion_logprobs(
        model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, batch.temperature,
        options=options, model_inputs=batch.model_inputs,
    )
    assert logps.requires_grad and entropies is not None
    _assert_rows_match(logps, expected, batch)
    (logps * batch.completion_mask).sum().backward()
    vision_grads = [p.grad for n, p in model.named_parameters() if "visual" in n and p.grad is not None]
    assert vision_grads and any(g.abs().sum() > 0 for g in vision_grads)  # the images reach the loss


@pytest.mark.parametrize("chunk_size, budget", [(1, None), (4, None), (6, 40), (6, 10_000)])
def test_no_grad_passes_equal_the_training_pass(setup, chunk_size, budget):
    """Old/reference log-probs (rows_logprobs: row chunks or token-budget groups) equal the
    training forward's on every real completion token."""
    model, _, prompts, batch = setup
    training, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                      batch.completion_mask, batch.temperature, model_inputs=batch.model_inputs)
    options = replace(ForwardOptions(), logprob_token_budget=budget)
    with torch.no_grad():
        old = rows_logprobs(model, batch, chunk_size, options, nullcontext)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(old[mask].double(), training.detach()[mask].double(), rtol=0, atol=ATOL)


def test_shuffled_micro_batches_keep_each_rows_images(setup):
    from grpo_lightning.data.collate import shuffle_and_split

    model, _, prompts, batch = setup
    with torch.no_grad():
        expected = _reference(model, prompts, batch)
        full, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                      batch.completion_mask, batch.temperature, model_inputs=batch.model_inputs)
        for chunk in shuffle_and_split(batch, 2, torch.Generator().manual_seed(3)):
            logps, _ = completion_logprobs(model, chunk.prompt_ids, chunk.prompt_mask, chunk.completion_ids,
                                           chunk.completion_mask, chunk.temperature, model_inputs=chunk.model_inputs)
            for row in range(len(chunk)):
                source = next(i for i in range(len(batch)) if torch.equal(
                    batch.completion_ids[i][batch.completion_mask[i].bool()],
                    chunk.completion_ids[row][chunk.completion_mask[row].bool()]))
                got = logps[row][chunk.completion_mask[row].bool()].double()
                torch.testing.assert_close(got, expected[source], rtol=0, atol=ATOL)
    assert full.shape == batch.completion_ids.shape


def test_other_images_give_other_logprobs(setup):
    model, tokenizer, prompts, batch = setup
    swapped = _prompts(tokenizer, seeds=(5, 6, 7))  # same sizes, other pixels
    other = replace(batch, model_inputs=_batch(swapped, tokenizer).model_inputs)
    with torch.no_grad():
        a, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask, 1.0, model_inputs=batch.model_inputs)
        b, _ = completion_logprobs(model, other.prompt_ids, other.prompt_mask, other.completion_ids,
                                   other.completion_mask, 1.0, model_inputs=other.model_inputs)
    assert (a - b)[batch.completion_mask.bool()].abs().max() > 1e-6


def test_a_row_count_mismatch_is_an_error(setup):
    model, _, _, batch = setup
    with pytest.raises(ValueError, match="5 rows of image inputs for a batch of 6 rows"):
        completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                            1.0, model_inputs=batch.model_inputs.select(range(5)))


def test_the_chunked_head_runs_on_real_completion_tokens_only(setup):
    """With ``chunked_lm_head`` the model's own head sees one position per row and the chunks hold
    only real completion tokens; the plain path's head sees T+1 positions per row."""
    model, _, _, batch = setup
    shapes = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape[:-1])))
    try:
        with torch.no_grad():
            completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                                1.0, options=ForwardOptions(lm_head_chunk_tokens=8), model_inputs=batch.model_inputs)
            chunked, shapes[:] = list(shapes), []
            completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                                1.0, options=ForwardOptions.plain(), model_inputs=batch.model_inputs)
    finally:
        hook.remove()
    real = int(batch.completion_mask.sum())  # 20 real completion tokens
    assert chunked[0] == (6, 1) and [s[0] for s in chunked[1:]] == [8, 8, real - 16]
    assert shapes == [(6, batch.completion_ids.shape[1] + 1)]

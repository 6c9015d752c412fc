"""Gemma3 and LLaVA-NeXT (the VLM families of TRL's tested list not covered elsewhere) and
Qwen3-VL (its tool-images family: interleaved M-RoPE, DeepStack features), tiny:
every pass gives each row's log-probs scored alone (rows of one and two images, LLaVA-NeXT rows
of different tile counts, Gemma3's bidirectional image attention from its ``token_type_ids``),
batched greedy generation gives each prompt's completion alone, and two optimizer steps train
the vision tower and the language model (Qwen3-VL: with gradient checkpointing)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from grpo_lightning.data.multimodal import encode_row_prompt
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.forward import completion_logprobs
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.module.model_loading import load_tokenizer
from grpo_lightning.module.training_forward import rows_logprobs
from grpo_lightning.samplers import HFGenerateSampler
from grpo_lightning.types import GenerationParams
from tests.helpers import built
from tests.vlm import tiny_vlm
from tests.vlm.test_vlm_forward import _alone, _batch  # 2 completions per prompt, temperature 0.7
from tests.vlm.test_vlm_training import changed_parameters, fit

ATOL = 4e-6  # a float64 model, float32 log-probs (|logp| ~ 12: float32 spacing ~1e-6)
#: family -> (model builder, the vision tower's attribute); processors from ``tiny_vlm.asset_processor``.
FAMILIES = {"gemma3": (tiny_vlm.gemma3_model, "vision_tower"),
            "llava_next": (tiny_vlm.llava_next_model, "vision_tower"),
            "qwen3_vl": (tiny_vlm.qwen3_vl_model, "visual")}
# Per prompt: its images' sizes; the second prompt has two images of different aspect ratios.
IMAGES = [[(40, 36)], [(60, 30), (30, 60)], [(64, 64)]]
GREEDY = GenerationParams(max_completion_length=5, generation_kwargs={"do_sample": False})


def _processor(name, shared_assets):
    """The tiny ``name`` processor over the Qwen2.5 tokenizer asset (skips where it cannot be built)."""
    return tiny_vlm.asset_processor(name, shared_assets)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, shared_assets):
    return request.param, _processor(request.param, shared_assets), FAMILIES[request.param][0]


def _vision_part(name):
    return FAMILIES[name][1]


def _prompts(tokenizer, seed=0):
    return [encode_row_prompt({"prompt": [{"role": "user", "content": f"what is {i}?"}],
                               "images": [tiny_vlm.color_image(seed + 10 * i + j, size) for j, size in enumerate(sizes)]},
                              i, tokenizer) for i, sizes in enumerate(IMAGES)]


def test_the_processors_give_what_the_tests_rely_on(family):
    name, processor, _ = family
    prompts = _prompts(load_tokenizer(processor))
    if name == "gemma3":  # bidirectional attention within an image: its soft tokens are marked
        assert all(p.token_fields == ("token_type_ids",) for p in prompts)
        assert [int(p.model_inputs["token_type_ids"].sum()) for p in prompts] == [4, 8, 4]
        assert [p.model_inputs["pixel_values"].shape[0] for p in prompts] == [1, 2, 1]
    elif name == "qwen3_vl":  # flattened patches; one (t, h, w) grid per image, grids differ in size
        grids = [p.model_inputs["image_grid_thw"].tolist() for p in prompts]
        assert [len(g) for g in grids] == [1, 2, 1] and len({tuple(g) for gs in grids for g in gs}) > 1, grids
        assert all(p.token_fields == ("mm_token_type_ids",) for p in prompts)
    else:  # anyres tiles: (images, tiles, 3, 32, 32), the grid chosen by each image's aspect ratio
        tiles = [p.model_inputs["pixel_values"].shape[:2] for p in prompts]
        assert [t[0] for t in tiles] == [1, 2, 1] and len({t[1] for t in tiles}) > 1, tiles
        assert [p.model_inputs["image_sizes"].tolist() for p in prompts][1] == [[30, 60], [60, 30]]


@pytest.mark.parametrize("options", [ForwardOptions(), ForwardOptions.plain(), ForwardOptions(lm_head_chunk_tokens=3)],
                         ids=["chunked_head", "plain", "chunks_of_3"])
def test_training_and_no_grad_passes_match_each_row_alone(family, options):
    _, processor, build_model = family
    tokenizer = load_tokenizer(processor)
    model = build_model(tokenizer).double().eval()
    prompts = _prompts(tokenizer)
    batch = _batch(prompts, tokenizer)
    logps, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask, batch.temperature, model_inputs=batch.model_inputs,
                                   options=options)
    assert logps.requires_grad
    with torch.no_grad():
        old = rows_logprobs(model, batch, 2, options, nullcontext)  # 2 micro-batches, each its rows' images
    for row in range(len(batch)):
        mask = batch.completion_mask[row].bool()
        expected = _alone(model, prompts[row // 2], batch.completion_ids[row][mask], batch.temperature)
        torch.testing.assert_close(logps[row][mask].double(), expected, rtol=0, atol=ATOL)
        torch.testing.assert_close(old[row][mask], logps[row][mask].detach(), rtol=0, atol=ATOL)


def _head_inputs(model, batch, options):
    """The leading shapes of what the model's LM head receives in one forward of ``batch``."""
    shapes = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: shapes.append(tuple(args[0].shape[:-1])))
    try:
        with torch.no_grad():
            completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                                1.0, options=options, model_inputs=batch.model_inputs)
    finally:
        hook.remove()
    return shapes


def test_the_chunked_head_runs_on_real_completion_tokens_only(family):
    _, processor, build_model = family
    tokenizer = load_tokenizer(processor)
    model = build_model(tokenizer).eval()
    batch = _batch(_prompts(tokenizer), tokenizer)
    real = int(batch.completion_mask.sum())  # 20 real completion tokens
    assert _head_inputs(model, batch, ForwardOptions(lm_head_chunk_tokens=8)) == [(6, 1), (8,), (8,), (real - 16,)]
    assert _head_inputs(model, batch, ForwardOptions.plain()) == [(6, batch.completion_ids.shape[1] + 1)]


def test_a_soft_capped_gemma3_keeps_the_models_logits(shared_assets, monkeypatch, caplog):
    """A final logit soft-cap is not applied by every transformers release's Gemma3 VLM forward:
    the model's own logits are used, whatever it does, with a log line."""
    from grpo_lightning.module import multimodal_forward

    processor = _processor("gemma3", shared_assets)
    tokenizer = load_tokenizer(processor)
    model = tiny_vlm.gemma3_model(tokenizer).eval()
    model.config.get_text_config().final_logit_softcapping = 3.0
    batch = _batch(_prompts(tokenizer), tokenizer)
    monkeypatch.setattr(multimodal_forward, "_logged", set())
    with caplog.at_level("INFO", logger=multimodal_forward.__name__):
        shapes = _head_inputs(model, batch, ForwardOptions(lm_head_chunk_tokens=8))
    assert shapes == [(6, batch.completion_ids.shape[1] + 1)]
    assert "chunked LM head off for model type 'gemma3' (its text config sets final_logit_softcapping)" in caplog.text


def test_the_images_reach_the_log_probs(family):
    _, processor, build_model = family
    tokenizer = load_tokenizer(processor)
    model = build_model(tokenizer).double().eval()
    a, b = _batch(_prompts(tokenizer), tokenizer), _batch(_prompts(tokenizer, seed=100), tokenizer)
    with torch.no_grad():
        la, _ = completion_logprobs(model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask,
                                    a.temperature, model_inputs=a.model_inputs)
        lb, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                    b.temperature, model_inputs=b.model_inputs)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert (la - lb).abs().max() > 1e-4, "other pixels, same log-probs: the images did not reach the forward"


@pytest.mark.slow
def test_a_batch_of_image_prompts_generates_what_each_prompt_generates_alone(family):
    _, processor, build_model = family
    module = built(GRPOModule(build_model(processor.tokenizer).double().eval(), tokenizer=processor,
                              save_final_model=False))
    sampler = HFGenerateSampler()
    sampler.bind(module)
    prompts = _prompts(module.tokenizer)
    together = sampler.generate(prompts, 2, GREEDY)  # left-padded, the pixel inputs of 6 rows
    alone = [r for p in prompts for r in sampler.generate([p], 2, GREEDY)]
    assert [r.completion_ids for r in together] == [r.completion_ids for r in alone]
    assert [r.prompt_ids for r in together] == [list(p) for p in prompts for _ in range(2)]


@pytest.mark.slow
def test_two_optimizer_steps_train_the_vision_tower_and_the_language_model(tmp_path, family):
    name, processor, build_model = family
    module, trainer, before, _ = fit(tmp_path, processor, model=build_model(processor.tokenizer),
                                     module_kwargs={"save_final_model": False,
                                                    "gradient_checkpointing": name == "qwen3_vl"})
    assert trainer.global_step == 2
    changed = changed_parameters(module, before)
    assert any(_vision_part(name) in n for n in changed), "the vision tower got no update: the images did not reach the loss"
    assert any("language_model" in n for n in changed)

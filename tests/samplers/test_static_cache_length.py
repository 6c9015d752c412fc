"""A static KV cache is sized in buckets, so that requests of other prompt widths reuse its shape
(and a compiled decode step its compilation)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers import HFGenerateSampler
from grpo_lightning.samplers.hf_generate import STATIC_CACHE_BUCKET, static_cache_length
from grpo_lightning.types import GenerationParams
from tests.helpers import built, make_model_dir


def _bound_sampler(tmp_path, monkeypatch, **sampler_args):
    """A static-cache HFGenerateSampler on a tiny module, and the max_cache_len of each generate call."""
    torch.manual_seed(0)
    module = built(GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False))
    sampler = HFGenerateSampler(cache_implementation="static", **sampler_args)
    sampler.bind(module)
    lengths: list[int] = []
    original = type(module.policy).generate

    def spy(model, *args, generation_config=None, **kwargs):
        lengths.append(generation_config.max_cache_len)
        return original(model, *args, generation_config=generation_config, **kwargs)

    monkeypatch.setattr(type(module.policy), "generate", spy)
    return module, sampler, lengths


def test_static_cache_length_rounds_up_to_the_bucket():
    config = GenerationConfig(max_new_tokens=100, cache_implementation="static")
    assert static_cache_length(config, 30).max_cache_len == STATIC_CACHE_BUCKET
    assert static_cache_length(config, STATIC_CACHE_BUCKET - 100).max_cache_len == STATIC_CACHE_BUCKET
    assert static_cache_length(config, STATIC_CACHE_BUCKET - 99).max_cache_len == 2 * STATIC_CACHE_BUCKET
    assert config.max_cache_len is None, "the request's config is not modified"


def test_dynamic_cache_and_a_given_length_are_left_alone():
    dynamic = GenerationConfig(max_new_tokens=100)
    assert static_cache_length(dynamic, 30) is dynamic
    given = GenerationConfig(max_new_tokens=100, cache_implementation="static", max_cache_len=1000)
    assert static_cache_length(given, 30).max_cache_len == 1000


def test_requests_of_other_widths_generate_on_one_cache_shape(tmp_path, monkeypatch):
    module, sampler, lengths = _bound_sampler(tmp_path, monkeypatch)
    params = GenerationParams(max_completion_length=8)
    for text in ("1+2=", "12+34+56+78="):
        prompt = module.tokenizer(text)["input_ids"]
        rollouts = sampler.generate([prompt], 4, params)
        assert len(rollouts) == 4 and all(1 <= len(r.completion_ids) <= 8 for r in rollouts)
        assert all(r.prompt_ids == prompt for r in rollouts)
    assert lengths == [STATIC_CACHE_BUCKET, STATIC_CACHE_BUCKET]


def test_the_bucket_stops_at_the_model_context_when_the_request_fits():
    config = GenerationConfig(max_new_tokens=100, cache_implementation="static")
    assert static_cache_length(config, 300, context_limit=448).max_cache_len == 448
    assert static_cache_length(config, 400, context_limit=448).max_cache_len == 512, "a request past it keeps its bucket"


def test_every_call_of_a_request_shares_the_widest_prompt_s_cache_size(tmp_path, monkeypatch):
    module, sampler, lengths = _bound_sampler(tmp_path, monkeypatch, max_batch_rows=2)
    narrow = module.tokenizer("1+2=")["input_ids"]
    wide = module.tokenizer("1+" * 125 + "=")["input_ids"]  # past one bucket with the new tokens
    assert len(narrow) + 8 <= STATIC_CACHE_BUCKET < len(wide) + 8
    sampler.generate([narrow, wide], 2, GenerationParams(max_completion_length=8))
    expected = 2 * STATIC_CACHE_BUCKET
    if module.max_context_length is not None and len(wide) + 8 <= module.max_context_length < expected:
        expected = module.max_context_length
    assert lengths == [expected, expected], "the narrow call is sized for the wide one"

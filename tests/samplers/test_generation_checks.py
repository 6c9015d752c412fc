"""Generation settings that would train on something other than samples of the policy, or fail after
the model loaded, are refused when the run is configured, with the setting to use instead."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from grpo_lightning.agents.tool_loop import AgentSampler
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.errors import ConfigError
from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers import get_sampler
from grpo_lightning.samplers.generation_checks import hf_generation_keys
from grpo_lightning.samplers.hf_generate import HFGenerateSampler
from grpo_lightning.samplers.vllm_colocate import VLLMColocateSampler
from grpo_lightning.samplers.vllm_server import VLLMServerSampler
from grpo_lightning.tools import Toolbox
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


def kwargs(**values) -> GenerationParams:
    return GenerationParams(max_completion_length=4, generation_kwargs=values)


@pytest.mark.parametrize("field, value, rule", [
    ("top_p", 1.5, r"in \(0, 1\]"), ("top_p", 0.0, r"in \(0, 1\]"), ("top_k", -2, ">= 0"),
    ("min_p", 1.5, r"in \[0, 1\]"), ("min_p", -0.1, r"in \[0, 1\]"), ("repetition_penalty", 0.0, "> 0"),
])
def test_sampling_fields_out_of_range(field, value, rule):
    with pytest.raises(ValueError, match=rf"data\.generation\.{field}={value}: it must be {rule}"):
        GenerationParams(**{field: value})


def test_sampling_fields_at_their_bounds_are_accepted():
    GenerationParams(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    GenerationParams(top_p=0.01, min_p=1.0, repetition_penalty=0.5)
    assert GenerationParams(top_k=-1).top_k == 0  # vLLM's old "disabled"


@pytest.mark.parametrize("sampler", ["hf_generate", "continuous_batching", "fast_generate"])
@pytest.mark.parametrize("key, field", [
    ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
    ("repetition_penalty", "repetition_penalty"), ("max_new_tokens", "max_completion_length"),
    ("max_length", "max_completion_length"),
])
def test_a_kwarg_that_repeats_a_field_names_the_field(sampler, key, field):
    with pytest.raises(ConfigError, match=rf"generation_kwargs\.{key}=.*set data\.generation\.{field} instead"):
        get_sampler(sampler).check_generation(kwargs(**{key: 0.5}))


@pytest.mark.parametrize("key", ["num_return_sequences", "n", "best_of"])
def test_more_completions_per_request_point_at_num_generations(key):
    for sampler in (get_sampler("hf_generate"), VLLMServerSampler(base_url="http://127.0.0.1:1")):
        with pytest.raises(ConfigError, match=r"data\.num_generations"):
            sampler.check_generation(kwargs(**{key: 2}))


@pytest.mark.parametrize("values", [{"do_sample": False}, {"num_beams": 4}, {"use_beam_search": True}])
def test_greedy_and_beam_search_are_refused(values):
    with pytest.raises(ConfigError, match="GRPO learns from samples of the policy"):
        get_sampler("hf_generate").check_generation(kwargs(**values))


@pytest.mark.parametrize("key", ["eos_token_id", "pad_token_id", "stop_strings", "return_dict_in_generate", "penalty_alpha"])
def test_settings_the_hf_samplers_own(key):
    with pytest.raises(ConfigError, match=rf"generation_kwargs\.{key}=.* cannot be set with data\.sampler: hf_generate"):
        get_sampler("hf_generate").check_generation(kwargs(**{key: 1}))


def test_an_unknown_hf_setting_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"\['tempreature'\] is not a setting of data\.sampler: fast_generate"):
        get_sampler("fast_generate").check_generation(kwargs(tempreature=0.5))


def test_real_hf_settings_pass():
    assert {"no_repeat_ngram_size", "typical_p", "min_new_tokens"} <= hf_generation_keys()
    get_sampler("hf_generate").check_generation(kwargs(no_repeat_ngram_size=3, min_new_tokens=1, do_sample=True))


@pytest.mark.parametrize("key", ["seed", "logprobs", "stop_token_ids"])
def test_settings_the_vllm_samplers_own(key):
    for sampler in (VLLMColocateSampler(), VLLMServerSampler(base_url="http://127.0.0.1:1")):
        with pytest.raises(ConfigError, match=rf"generation_kwargs\.{key}=1 cannot be set with data\.sampler: vllm_"):
            sampler.check_generation(kwargs(**{key: 1}))


def test_vllm_takes_its_own_settings():
    VLLMServerSampler(base_url="http://127.0.0.1:1").check_generation(kwargs(stop=["\n\n"], presence_penalty=0.1))


def test_an_agent_sampler_checks_with_its_inner_back_end():
    agent = AgentSampler(get_sampler("hf_generate"), Toolbox.of([_noop_tool]))
    with pytest.raises(ConfigError, match="not a setting of data.sampler: hf_generate"):
        agent.check_generation(kwargs(tempreature=0.5))


def _noop_tool(text: str) -> str:
    """Return the text.

    Args:
        text: Any text.
    """
    return text


def test_the_datamodule_refuses_before_loading_anything():
    with pytest.raises(ConfigError, match=r"data\.generation\.generation_kwargs\.temperature"):
        RolloutDataModule("never-loaded.jsonl", reward_funcs=[length_reward], generation=kwargs(temperature=0.7))


@pytest.mark.parametrize("eval_kwargs, message", [
    ({"per_device_eval_batch_size": 0}, r"data\.per_device_eval_batch_size=0: it must be a positive multiple"),
    ({"num_generations_eval": 0}, r"data\.num_generations_eval=0: it must be at least 1"),
])
def test_evaluation_sizes(tmp_path, eval_kwargs, message):
    prompts = write_prompts(tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match=message):
        RolloutDataModule(prompts, reward_funcs=[length_reward], num_generations=4, per_device_train_batch_size=8,
                          eval_dataset=prompts, **eval_kwargs)


@pytest.mark.parametrize("trainer_kwargs, message", [
    ({"gradient_clip_val": -1.0}, r"trainer\.gradient_clip_val=-1\.0: it must be > 0"),
    ({"log_every_n_steps": 0}, r"trainer\.log_every_n_steps=0: it must be positive"),
    ({"limit_train_batches": 0}, r"trainer\.limit_train_batches=0 trains nothing"),
])
def test_trainer_settings_are_checked_without_the_cli(tmp_path, trainer_kwargs, message):
    """A Python ``Trainer`` gets the same checks as ``grpo fit``, before the model is built."""
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, **trainer_kwargs)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    module = GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False)
    with pytest.raises(ConfigError, match=message):
        trainer.fit(module, data)
    assert "policy" not in module._modules  # refused before configure_model built it


def test_a_completion_length_that_fills_the_context_fails_before_the_model_is_built(tmp_path):
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=256))
    module = GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False)  # max_position_embeddings 256
    with pytest.raises(ValueError, match=r"max_completion_length=256 leaves no room for a prompt .* of 256 tokens"):
        trainer.fit(module, data)
    assert "policy" not in module._modules


def test_an_unknown_cache_implementation_fails_at_construction():
    with pytest.raises(ValueError, match=r"cache_implementation='statc': use one of \[.*'static'"):
        HFGenerateSampler(cache_implementation="statc")
    with pytest.raises(ValueError, match=r"generation_kwargs\.cache_implementation='statc'"):
        get_sampler("hf_generate").check_generation(kwargs(cache_implementation="statc"))


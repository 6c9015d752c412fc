"""Bad input gets one clear error naming the setting and the fix, before any generation runs."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.model_loading import load_tokenizer
from grpo_lightning.types import GenerationParams
from grpo_lightning.utils.tiny_models import build_char_tokenizer
from tests.helpers import length_reward, make_model_dir, write_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model") / "m")


def fit(model_dir, dataset, reward=length_reward, **data_kwargs):
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    data_kwargs = {"num_generations": 4, "per_device_train_batch_size": 8, **data_kwargs}
    data = RolloutDataModule(dataset, reward_funcs=[reward], generation=GenerationParams(max_completion_length=4), **data_kwargs)
    trainer.fit(GRPOModule(model_dir, save_final_model=False), data)


def test_unknown_loss_name(model_dir):
    with pytest.raises(ValueError, match="grpo.*dapo|class_path"):
        GRPOModule(model_dir, loss="ppo")


def test_missing_prompt_column_is_reported_before_generation(model_dir, tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"{i}+1="}) for i in range(8)))
    with pytest.raises(ValueError, match=r"prompt_column"):
        fit(model_dir, str(path))


def test_batch_that_num_generations_does_not_divide(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"data\.num_generations"):
        fit(model_dir, write_prompts(tmp_path / "p.jsonl"), num_generations=3, per_device_train_batch_size=8)


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        ({"num_generations": 1}, "data.num_generations"),
        ({"generation_batch_size": 16, "steps_per_generation": 2}, "data.steps_per_generation"),
        ({"generation_batch_size": 10}, "data.generation_batch_size"),
        ({"scale_rewards": "batchwise"}, "data.scale_rewards"),
        ({"reward_weights": [1.0, 2.0]}, "data.reward_weights"),
    ],
)
def test_inconsistent_data_settings_fail_at_construction(kwargs, setting):
    with pytest.raises(ValueError, match=setting.replace(".", r"\.")):
        RolloutDataModule("unused.jsonl", reward_funcs=[length_reward], **kwargs)


def test_bad_generation_params():
    with pytest.raises(ValueError, match="temperature"):
        GenerationParams(temperature=0.0)


def test_reward_returning_wrong_length_names_the_function(model_dir, tmp_path):
    def short_reward(completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="short_reward"):
        fit(model_dir, write_prompts(tmp_path / "p.jsonl"), reward=short_reward)


def test_reward_returning_text_names_the_function(model_dir, tmp_path):
    def text_reward(completions, **kwargs):
        return ["good"] * len(completions)

    with pytest.raises((ValueError, TypeError), match="text_reward"):
        fit(model_dir, write_prompts(tmp_path / "p.jsonl"), reward=text_reward)


def test_tokenizer_without_pad_uses_eos_and_without_eos_is_rejected():
    tokenizer = build_char_tokenizer("ab")
    tokenizer.pad_token = None
    assert load_tokenizer(tokenizer).pad_token == tokenizer.eos_token
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="EOS"):
        load_tokenizer(tokenizer)


def test_prompt_longer_than_the_model_context_names_rows_and_fix(tmp_path):
    from grpo_lightning.utils.tiny_models import build_tiny_causal_lm
    from tests.helpers import ALPHABET

    if not hasattr(GRPOModule, "max_context_length"):  # the handle's context length, read by the builder
        pytest.skip("GRPOModule does not expose max_context_length yet")
    tokenizer = build_char_tokenizer(ALPHABET)
    short_context = tmp_path / "short"
    build_tiny_causal_lm(len(tokenizer), max_position_embeddings=16).save_pretrained(short_context)
    tokenizer.save_pretrained(short_context)
    path = tmp_path / "long.jsonl"
    prompts = ["1+1="] * 7 + ["1+1+1+1+1+1+1="]  # row 7: 14 tokens + 4 new ones > 16
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    with pytest.raises(ValueError, match=r"row 7 \(14 tokens\).*max_completion_length=4.*context of 16 tokens.*at most 2"):
        fit(str(short_context), str(path), num_generations=2, per_device_train_batch_size=16, shuffle_dataset=False)


def test_eval_batch_size_is_checked_only_when_there_is_an_eval_set(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl")
    RolloutDataModule(prompts, reward_funcs=[length_reward], num_generations=3, per_device_train_batch_size=6)
    with pytest.raises(ValueError, match=r"data\.per_device_eval_batch_size"):
        RolloutDataModule(prompts, reward_funcs=[length_reward], num_generations=3, per_device_train_batch_size=6,
                          eval_dataset=prompts)

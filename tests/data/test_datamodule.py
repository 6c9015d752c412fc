"""RolloutDataModule construction: datasets loaded and reward functions checked against them
before any model loads or logger run exists; reward-model loading settings reach from_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_lightning.data import RolloutDataModule
from tests.helpers import length_reward, write_prompts


def needs_solution(completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution)]


def test_datasets_are_loaded_at_construction(tmp_path: Path):
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl", num_rows=6), reward_funcs=[length_reward],
                             eval_dataset={"a": write_prompts(tmp_path / "e.jsonl", num_rows=3)})
    assert len(data.train_dataset) == 6 and len(data.eval_datasets["a"]) == 3


def test_missing_dataset_file_fails_at_construction(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        RolloutDataModule(str(tmp_path / "missing.jsonl"), reward_funcs=[length_reward])
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward],
                          eval_dataset=str(tmp_path / "nope.jsonl"))


def test_reward_needing_a_missing_column_fails_at_construction(tmp_path: Path):
    prompts = write_prompts(tmp_path / "p.jsonl")  # columns: prompt, answer
    with pytest.raises(ValueError) as err:
        RolloutDataModule(prompts, reward_funcs=[needs_solution])
    message = str(err.value)
    assert "'needs_solution' requires the argument 'solution'" in message
    assert f"data.dataset '{prompts}'" in message and "its columns: answer" in message


def test_eval_set_lacking_a_reward_column_fails_at_construction(tmp_path: Path):
    train = tmp_path / "t.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) for i in range(8)))
    with pytest.raises(ValueError, match=r"'needs_solution' requires the argument 'solution'.*data\.eval_dataset\['hard'\]"):
        RolloutDataModule(str(train), reward_funcs=[needs_solution],
                          eval_dataset={"hard": write_prompts(tmp_path / "e.jsonl")})


def test_reward_without_kwargs_fails_at_construction(tmp_path: Path):
    def strict(completions, answer):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"'strict' is called with the keyword arguments prompts, completion_ids.*\*\*kwargs"):
        RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[strict])


def test_reward_model_settings_reach_from_pretrained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import torch
    import transformers

    from grpo_lightning.utils.tiny_models import build_char_tokenizer

    tok = build_char_tokenizer()
    folder = tmp_path / "rm"
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id,
    )
    transformers.LlamaForSequenceClassification(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    calls = {}

    def spy(cls_name, original):
        def from_pretrained(path, *args, **kwargs):
            calls[cls_name] = kwargs
            return original(path, *args, **kwargs)
        return from_pretrained

    for cls in (transformers.AutoModelForSequenceClassification, transformers.AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", spy(cls.__name__, cls.from_pretrained))
    data = RolloutDataModule(
        write_prompts(tmp_path / "p.jsonl"), reward_funcs=[str(folder), length_reward],
        reward_model_init_kwargs={"dtype": torch.float64, "revision": "main"}, reward_trust_remote_code=True,
    )
    model_kwargs, tokenizer_kwargs = calls["AutoModelForSequenceClassification"], calls["AutoTokenizer"]
    assert model_kwargs["dtype"] is torch.float64 and model_kwargs["revision"] == "main"
    assert model_kwargs["trust_remote_code"] is True and model_kwargs["num_labels"] == 1
    assert tokenizer_kwargs == {"trust_remote_code": True, "revision": "main"}
    assert data.rewards.reward_models[0].model.dtype == torch.float64

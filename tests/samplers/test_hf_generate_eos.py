"""Generation stops on every end-of-sequence id of the model, not only the tokenizer's EOS
(chat models end a turn with another id listed in their generation config)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo_lightning.module import GRPOModule
from grpo_lightning.module.model_info import read_model_info
from grpo_lightning.samplers import HFGenerateSampler
from grpo_lightning.types import GenerationParams
from tests.helpers import built, make_model_dir


def _with_generation_eos(model_dir: str, eos_ids: list[int]) -> str:
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "eos_token_id": eos_ids}))
    return model_dir


def test_model_info_reads_every_eos_id(tmp_path):
    model_dir = _with_generation_eos(make_model_dir(tmp_path / "m"), [2, 7, 9])
    module = GRPOModule(model_dir, save_final_model=False)
    eos = module.tokenizer.eos_token_id
    assert module.eos_token_ids[0] == eos and set(module.eos_token_ids) == {eos, 2, 7, 9}
    assert read_model_info(model_dir).max_context_length == module.max_context_length > 0


def test_generation_stops_on_a_generation_config_eos_id(tmp_path):
    torch.manual_seed(0)
    plain = built(GRPOModule(make_model_dir(tmp_path / "a"), save_final_model=False))
    sampler = HFGenerateSampler()
    sampler.bind(plain)
    params = GenerationParams(max_completion_length=12)
    prompt = plain.tokenizer("1+2=")["input_ids"]
    baseline = sampler.generate([prompt], 16, params)
    tokens = {t for r in baseline for t in r.completion_ids[:-1]}  # ids sampled before the end
    assert tokens, "the tiny model must sample some tokens"
    stop = sorted(tokens)[:3]  # ids the model does emit become end-of-turn ids
    chat = built(GRPOModule(_with_generation_eos(make_model_dir(tmp_path / "b"), stop), save_final_model=False))
    sampler.bind(chat)
    torch.manual_seed(0)
    rollouts = sampler.generate([prompt], 16, params)
    stopped = [r for r in rollouts if r.ended_on_eos and r.completion_ids[-1] in stop]
    assert stopped, "some completion must end on a generation-config EOS id"
    for r in rollouts:
        ends = [i for i, t in enumerate(r.completion_ids) if t in chat.eos_token_ids]
        assert ends == ([len(r.completion_ids) - 1] if r.ended_on_eos else []), "cut after the first end id"
        assert r.ended_on_eos or len(r.completion_ids) == params.max_completion_length

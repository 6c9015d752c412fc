"""``GRPOModule(forward=ForwardOptions(...))`` reaches both log-prob calls and the CLI."""

from __future__ import annotations

import pytest
import torch
import yaml

from grpo_lightning.module import grpo_module
from grpo_lightning.module.forward import ForwardOptions
from grpo_lightning.module.grpo_module import GRPOModule
from grpo_lightning.types import RolloutBatch
from tests.helpers import built, make_model_dir, write_prompts
from tests.module.test_forward_paths import reference
from tests.numerics import assert_close_f32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("forward_options") / "model")


def _batch(rows=4):
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 1]])[:rows]
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])[:rows]
    return RolloutBatch(
        prompt_ids=torch.randint(5, 15, prompt_mask.shape, generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(5, 15, completion_mask.shape, generator=g) * completion_mask,
        completion_mask=completion_mask,
        advantages=torch.zeros(rows),
        num_items_in_batch=completion_mask.sum().float(),
        policy_versions=torch.zeros(rows, dtype=torch.long),
        temperature=0.8,
    )


def test_default_options_and_rollout_logprobs_pass_them(model_dir, monkeypatch):
    assert GRPOModule(model_dir, save_final_model=False).forward_options == ForwardOptions()
    options = ForwardOptions(lm_head_chunk_tokens=3, logprob_token_budget=7)
    module = built(GRPOModule(model_dir, save_final_model=False, forward=options))
    assert module.forward_options is options
    seen = []
    original = grpo_module.completion_logprobs

    def spy(*args, **kwargs):
        seen.append(kwargs.get("options"))
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo_module, "completion_logprobs", spy)
    batch = _batch()
    logps = module.rollout_logprobs(batch, reference=False, chunk_size=2)
    assert seen == [options]  # with a token budget the forward groups the whole batch by tokens itself
    plain = built(GRPOModule(model_dir, save_final_model=False, forward=ForwardOptions.plain()))
    got_plain = plain.rollout_logprobs(batch, reference=False, chunk_size=4)
    fields = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, batch.advantages)
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_dir)  # the weights both modules load
    want = reference(policy, fields, grad=False, temperature=batch.temperature)  # float64
    mask = batch.completion_mask.bool()
    for got in (logps, got_plain):
        assert_close_f32(got[mask], want.logps[mask], reduction_size=want.values_size, scale=want.logit_scale)


def forward_options_from_cli(tmp_path, forward: dict, *args: str) -> ForwardOptions:
    """The module's ``forward_options`` after ``grpo fit`` parses a config with ``model.forward:
    <forward>`` and the extra command-line ``args`` (nothing is trained)."""
    from grpo_lightning import cli

    config = {
        "trainer": {"max_steps": 1, "accelerator": "cpu", "default_root_dir": str(tmp_path / "run"),
                    "enable_progress_bar": False, "logger": False},
        "model": {"model": make_model_dir(tmp_path / "model"), "save_final_model": False, "forward": forward},
        "data": {"dataset": write_prompts(tmp_path / "prompts.jsonl"), "reward_funcs": ["tests.helpers.length_reward"],
                 "num_generations": 2, "per_device_train_batch_size": 4,
                 "generation": {"max_completion_length": 4}},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    parsed = cli.GRPOLightningCLI(
        cli.GRPOModule, cli.RolloutDataModule, trainer_defaults=cli.TRAINER_DEFAULTS, save_config_callback=None,
        args=["--config", str(path), *args], run=False, auto_configure_optimizers=False,
    )
    return parsed.model.forward_options


def test_cli_sets_forward_options(tmp_path):
    options = forward_options_from_cli(tmp_path, {"padding_free": False, "lm_head_chunk_tokens": 64},
                                       "--model.forward.logprob_token_budget", "128")
    assert options == ForwardOptions(padding_free=False, lm_head_chunk_tokens=64, logprob_token_budget=128)

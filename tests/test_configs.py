"""Every shipped config parses and validates against the current signatures (no model is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_lightning.cli import GRPOLightningCLI, LogConfigToMLflow, TRAINER_DEFAULTS
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


class ParseOnly(GRPOLightningCLI):
    """Parses and validates the config, instantiates nothing."""

    def instantiate_classes(self) -> None:
        pass


def test_configs_exist():
    names = {c.name for c in CONFIGS}
    assert {"quickstart.yaml", "gsm8k_qwen2.5-0.5b.yaml"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses(config, monkeypatch):
    monkeypatch.chdir(config.parents[1])  # configs use repo-relative paths
    cli = ParseOnly(
        GRPOModule, RolloutDataModule, trainer_defaults=TRAINER_DEFAULTS, save_config_callback=LogConfigToMLflow,
        run=False, args=["--config", str(config)],
    )
    assert cli.config.data.reward_funcs, "a config without rewards cannot train"
    assert cli.config.model.model


def test_loss_and_sampler_by_class_path_with_knobs(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(
        """
model:
  model: unused
  loss:
    class_path: grpo_lightning.losses.CISPOLoss
    init_args: {epsilon_high: 5.0, beta: 0.04}
data:
  dataset: unused.jsonl
  reward_funcs: [exact_match_reward]
  sampler:
    class_path: grpo_lightning.samplers.HFGenerateSampler
    init_args: {max_batch_rows: 16, cache_implementation: static}
"""
    )
    cli = ParseOnly(GRPOModule, RolloutDataModule, run=False, args=["--config", str(config)])
    assert cli.config.model.loss.class_path == "grpo_lightning.losses.CISPOLoss"
    assert cli.config.model.loss.init_args.epsilon_high == 5.0
    assert cli.config.data.sampler.init_args.max_batch_rows == 16


def test_loss_by_short_class_name_and_by_name(tmp_path):
    for loss in ["DAPOLoss", "sapo"]:
        cli = ParseOnly(
            GRPOModule, RolloutDataModule, run=False,
            args=["--model.model", "m", "--data.dataset", "d.jsonl", "--data.reward_funcs", "[exact_match_reward]",
                  "--model.loss", loss],
        )
        assert cli.config.model.loss


# The columns of the Hub datasets the recipes train on: the datamodule loads its datasets and
# checks the reward functions against their columns when it is built.
HUB_COLUMNS = {
    "openai/gsm8k": {"question": "1+1?", "answer": "1+1=2 #### 2"},
    "Jiayi-Pan/Countdown-Tasks-3to4": {"target": 7, "nums": [3, 4]},
    "DigitalLearningGmbH/MATH-lighteval": {"problem": "1+1?", "level": "Level 1", "type": "Algebra",
                                           "solution": "$\\boxed{2}$"},
    "HuggingFaceH4/MATH-500": {"problem": "1+1?", "solution": "$\\boxed{2}$", "answer": "2", "subject": "Algebra",
                               "level": 1, "unique_id": "a"},
}


def offline_hub(tmp_path, rows: int = 1):
    """``load_prompt_dataset`` that serves the recipes' Hub datasets as ``rows``-row local files
    with their real columns (local paths load as usual)."""
    import json

    from grpo_lightning.data import prompt_sets

    real = prompt_sets.load_prompt_dataset

    def load(path_or_name, **kwargs):
        if path_or_name not in HUB_COLUMNS:
            return real(path_or_name, **kwargs)
        local = tmp_path / (path_or_name.replace("/", "_") + ".jsonl")
        local.write_text((json.dumps(HUB_COLUMNS[path_or_name]) + "\n") * rows)
        return real(str(local), **{**kwargs, "name": None, "data_files": None})

    return load


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_instantiates_with_a_local_model(config, tmp_path, monkeypatch):
    """Rewards, losses, samplers and callbacks of every recipe resolve and fit its dataset's
    columns (the hub model and the GPU are swapped for a tiny local model on CPU, the Hub datasets
    for one-row files with their columns; nothing is downloaded or trained)."""
    from grpo_lightning.data import prompt_sets
    from tests.helpers import make_model_dir

    monkeypatch.setattr(prompt_sets, "load_prompt_dataset", offline_hub(tmp_path))
    monkeypatch.chdir(config.parents[1])
    cli = GRPOLightningCLI(
        GRPOModule, RolloutDataModule, trainer_defaults=TRAINER_DEFAULTS, save_config_callback=LogConfigToMLflow,
        run=False,
        args=["--config", str(config), "--model.model", make_model_dir(tmp_path / "m"),
              "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true",
              "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false"],
    )
    assert cli.datamodule.rewards.names
    assert cli.model.loss is not None


def test_default_loss_and_sampler_are_fresh_instances(tmp_path):
    """The defaults are ``lazy_instance`` objects (so the CLI lists their knobs); each module gets
    its own initialised instance, never the shared default object; names still work from Python."""
    from grpo_lightning.losses import DAPOLoss, GRPOLoss
    from grpo_lightning.samplers import HFGenerateSampler
    from tests.helpers import length_reward, make_model_dir, write_prompts

    model, prompts = make_model_dir(tmp_path / "m"), write_prompts(tmp_path / "p.jsonl")
    first, second = GRPOModule(model), GRPOModule(model)
    assert type(first.loss) is DAPOLoss and first.loss is not second.loss and first.loss.beta == 0.0
    assert type(GRPOModule(model, loss="grpo").loss) is GRPOLoss
    data = [RolloutDataModule(prompts, reward_funcs=[length_reward]) for _ in range(2)]
    assert type(data[0].sampler) is HFGenerateSampler and data[0].sampler is not data[1].sampler
    assert type(RolloutDataModule(prompts, reward_funcs=[length_reward], sampler="hf_generate").sampler) is HFGenerateSampler


# The GPU strategy recipes (configs/strategy/) are composed with a training recipe, not run alone:
# tests/module/test_strategies.py parses each composition and builds its strategy on CPU; here they
# train. Lightning runs FSDP and DeepSpeed on CUDA only, so on a CPU machine this is skipped (the
# DeepSpeed path's CPU check with DeepSpeed's own CPU engine is tests/module/test_deepspeed.py).
STRATEGY_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "strategy").glob("*.yaml"))


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGY_CONFIGS, ids=lambda p: p.name)
def test_strategy_config_trains_on_a_gpu(strategy, tmp_path, monkeypatch):
    """quickstart + the strategy recipe: 3 optimizer steps on one GPU, a finite loss, and a
    consolidated export that transformers loads."""
    import importlib.util
    import math

    import torch

    if not torch.cuda.is_available():
        pytest.skip("FSDP and DeepSpeed train on CUDA only: this machine has no CUDA device")
    if "deepspeed" in strategy.name and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (pip install 'grpo-lightning[deepspeed]')")
    from transformers import AutoModelForCausalLM

    from grpo_lightning.cli import run_cli

    monkeypatch.chdir(strategy.parents[2])
    run = tmp_path / "run"
    cli = run_cli(["fit", "--config", "configs/quickstart.yaml", "--config", str(strategy), "--trainer.devices", "1",
                   "--trainer.max_steps", "3", "--trainer.accumulate_grad_batches", "2", "--data.steps_per_generation", "2",
                   "--trainer.default_root_dir", str(run), "--trainer.logger", "false",
                   "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false"])
    assert cli.trainer.global_step == 3 and math.isfinite(cli.model.step_metrics["loss"])
    assert math.isfinite(cli.model.step_metrics["grad_norm"]) and cli.model.step_metrics["grad_norm"] > 0
    exported = AutoModelForCausalLM.from_pretrained(run / "final_model")
    assert sum(p.numel() for p in exported.parameters()) == sum(p.numel() for p in
                                                                 AutoModelForCausalLM.from_pretrained("examples/arithmetic/model").parameters())

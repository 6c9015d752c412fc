"""A run length that trains nothing is an error naming the setting (`max_steps: 0` planned 250 steps)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.data.micro_steps import MicroStepSchedule
from grpo_lightning.data.prompt_order import GenerationPlan
from grpo_lightning.data.rollout_builder import RolloutSettings
from grpo_lightning.data.run_summary import check_training_length, run_summary
from grpo_lightning.errors import ConfigError
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


@pytest.mark.parametrize("max_steps, max_epochs, setting", [
    (0, None, "trainer.max_steps=0"), (-2, None, "trainer.max_steps=-2"),
    (-1, 0, "trainer.max_epochs=0"), (None, -5, "trainer.max_epochs=-5"),
])
def test_nonsense_lengths_are_rejected(max_steps, max_epochs, setting):
    with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
        check_training_length(max_steps, max_epochs)


@pytest.mark.parametrize("max_steps, max_epochs", [(-1, None), (10, None), (-1, 3), (None, -1), (5, -1)])
def test_valid_lengths(max_steps, max_epochs):
    check_training_length(max_steps, max_epochs)


def test_fit_with_max_steps_zero_fails_before_generating(tmp_path):
    trainer = pl.Trainer(max_steps=0, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    with pytest.raises(ConfigError, match=r"trainer\.max_steps=0"):
        trainer.fit(GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False), data)


def test_summary_of_an_unlimited_run():
    plan = GenerationPlan(8, 1, 2, 8)
    settings = RolloutSettings(num_generations=4, plan=plan, params=GenerationParams(), gradient_accumulation_steps=1)
    trainer = SimpleNamespace(max_steps=-1, max_epochs=-1, accumulate_grad_batches=1, world_size=1)
    text = run_summary(settings, MicroStepSchedule(3, 1, 1), trainer, reference=False)
    assert "planned optimizer steps: no limit" in text

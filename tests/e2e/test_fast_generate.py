"""A short training run through ``RolloutDataModule(sampler=FastGenerateSampler())``: every batch
is sampled with the weights it is trained on (lag 0) and the sampler's log-probs are the policy's
own after every optimizer step (importance ratios of 1)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from grpo_lightning.algo.importance import ImportanceSamplingCorrection
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers.fast_generate import FastGenerateSampler
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


class Record(pl.Callback):
    def __init__(self):
        self.steps: list[tuple[int, list[int], dict[str, float]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((trainer.global_step - 1, batch.policy_versions.tolist(), dict(pl_module.step_metrics)))


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_fit_with_fast_generate(tmp_path, architecture):
    record = Record()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
                         default_root_dir=str(tmp_path / "run"))
    module = GRPOModule(make_model_dir(tmp_path / "model", architecture=architecture), learning_rate=1e-2,
                        save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp_path / "prompts.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, sampler=FastGenerateSampler(),
                             generation=GenerationParams(max_completion_length=8, temperature=0.8),
                             importance_sampling=ImportanceSamplingCorrection(mode="token_truncate"))
    trainer.fit(module, data)
    assert trainer.global_step == 3 and len(record.steps) == 3
    for step, versions, metrics in record.steps:
        assert versions == [step] * 8  # on-policy: sampled with the weights it is trained on
        # The trainer's log-probs against the sampler's: float32 rounding apart, after every update.
        assert metrics["sampling/sampling_logp_difference/max"] < 1e-4, (step, metrics)
        assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)

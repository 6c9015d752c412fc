"""The importance-sampling correction reaches the loss in a real training run: a sampler whose
log-probs are far from the policy's has every sequence masked (no update), the same run without
the correction updates, and a sampler reporting the policy's own log-probs gives ratios of 1."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning.algo.importance import ImportanceSamplingCorrection
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers import HFGenerateSampler
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


class ReportingSampler(HFGenerateSampler):
    """HF generate on the live policy, reporting each sampled token's log-prob: the policy's own
    (``offset=None``, computed in float64) or the constant ``offset``."""

    provides_logprobs = True

    def __init__(self, offset: float | None = None):
        super().__init__()
        self.offset = offset

    def generate(self, prompts, num_generations, params):
        rollouts = super().generate(prompts, num_generations, params)
        for r in rollouts:
            r.sampling_logprobs = [self.offset] * len(r.completion_ids) if self.offset is not None else self._own(r, params)
        return rollouts

    def _own(self, rollout, params):
        ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
        with torch.no_grad():
            logits = self.handle.policy(ids).logits.double()[0, len(rollout.prompt_ids) - 1 : -1] / params.temperature
        return logits.log_softmax(-1).gather(1, torch.tensor(rollout.completion_ids)[:, None])[:, 0].tolist()


class Metrics(pl.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(dict(pl_module.step_metrics))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("is")
    return make_model_dir(root / "model"), write_prompts(root / "prompts.jsonl")


def train(assets, tmp_path, sampler, correction=ImportanceSamplingCorrection()):
    model, prompts = assets
    module = GRPOModule(model, learning_rate=1e-2, weight_decay=0.0, save_final_model=False)
    data = RolloutDataModule(prompts, reward_funcs=[length_reward], num_generations=4, per_device_train_batch_size=8,
                             sampler=sampler, importance_sampling=correction,
                             generation=GenerationParams(max_completion_length=6))
    metrics = Metrics()
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[metrics],
                         default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    return module, metrics.steps[-1]


def weights_of(model_dir):
    from transformers import AutoModelForCausalLM

    return {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}


def changed(module, initial):
    return max((p.detach() - initial[n]).abs().max().item() for n, p in module.policy.named_parameters())


def test_far_off_sampler_is_masked_out_and_without_correction_it_trains(assets, tmp_path):
    initial = weights_of(assets[0])
    # Reported log-prob -50 per token: each sequence's ratio exp(sum(old + 50)) is far above 3.
    module, metrics = train(assets, tmp_path / "a", ReportingSampler(offset=-50.0))
    assert metrics["sampling/importance_sampling_ratio/max"] == 0.0
    assert metrics["sampling/sampling_logp_difference/mean"] > 40
    assert changed(module, initial) == 0.0  # every sequence weighted 0: no gradient, no update
    module, metrics = train(assets, tmp_path / "b", ReportingSampler(offset=-50.0), ImportanceSamplingCorrection(enabled=False))
    assert not any(name.startswith("sampling/") for name in metrics)
    assert changed(module, initial) > 0.0


def test_a_sampler_with_the_policys_own_logprobs_has_ratio_one(assets, tmp_path):
    _, metrics = train(assets, tmp_path, ReportingSampler(), ImportanceSamplingCorrection(mode="token_truncate"))
    # The trainer's float32 log-probs against a float64 recomputation: ~1e-6 apart.
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-4
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)

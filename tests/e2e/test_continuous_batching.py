"""``grpo fit`` with ``data.sampler: continuous_batching``: a short run trains, stamps every batch
with the step it is trained at, and the sampler's log-probs are the policy's own (importance
ratios of 1) after every optimizer step, through the kept paged cache."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from grpo_lightning.cli import run_cli
from grpo_lightning.samplers.continuous_batching import ContinuousBatchingSampler, check_engine_version
from tests.helpers import make_model_dir, write_prompts


class Record(pl.Callback):
    steps: list[tuple[int, list[int], dict[str, float]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        Record.steps.append((trainer.global_step - 1, batch.policy_versions.tolist(), dict(pl_module.step_metrics)))


def test_fit_with_continuous_batching(tmp_path):
    try:
        check_engine_version()
    except RuntimeError as error:
        pytest.skip(str(error))
    Record.steps = []
    config = tmp_path / "cfg.yaml"
    config.write_text(f"""
trainer: {{accelerator: cpu, max_steps: 3, logger: false, enable_checkpointing: false,
           enable_progress_bar: false, enable_model_summary: false, default_root_dir: {tmp_path / "run"},
           callbacks: [tests.e2e.test_continuous_batching.Record]}}
model: {{model: {make_model_dir(tmp_path / "model")}, learning_rate: 1.0e-2, save_final_model: false}}
data:
  dataset: {write_prompts(tmp_path / "prompts.jsonl")}
  reward_funcs: [tests.helpers.length_reward]
  num_generations: 4
  per_device_train_batch_size: 8
  generation: {{max_completion_length: 8, temperature: 0.8}}
  importance_sampling: {{mode: token_truncate}}
  sampler:
    class_path: grpo_lightning.samplers.continuous_batching.ContinuousBatchingSampler
    init_args: {{continuous_batching_config: {{page_size: 4}}}}
""")
    cli = run_cli(["fit", "--config", str(config)])
    sampler = cli.datamodule.sampler
    assert isinstance(sampler, ContinuousBatchingSampler) and sampler.engine_config is None, "closed at teardown"
    assert cli.trainer.global_step == 3 and len(Record.steps) == 3
    for step, versions, metrics in Record.steps:
        assert versions == [step] * 8  # on-policy: sampled with the weights it is trained on
        # The trainer's log-probs against the engine's: float32 rounding apart, after every update.
        assert metrics["sampling/sampling_logp_difference/max"] < 1e-4, (step, metrics)
        assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)

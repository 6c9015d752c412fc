"""Callbacks see every metric of a step, by its TRL name, in that step (``trainer.callback_metrics``
and ``pl_module.step_metrics``): ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` work from YAML."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import yaml

from grpo_lightning.cli import run_cli
from tests.helpers import make_model_dir, write_prompts


class RecordStepMetrics(pl.Callback):
    """Copies what a callback can read at the end of each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        assert metrics == pytest.approx(pl_module.step_metrics)
        self.steps.append(metrics)


@pytest.mark.slow
def test_checkpoint_and_early_stopping_monitor_trl_metrics_from_yaml(tmp_path):
    config = {
        "trainer": {
            "max_steps": 50, "accelerator": "cpu", "default_root_dir": str(tmp_path / "run"), "logger": False,
            "enable_progress_bar": False, "log_every_n_steps": 1,
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"monitor": "completions/mean_length", "mode": "max", "every_n_train_steps": 1,
                               "save_top_k": 1, "dirpath": str(tmp_path / "ckpt"), "filename": "best"}},
                # Stops at the first check (end of epoch 0): the threshold is always met.
                {"class_path": "lightning.pytorch.callbacks.EarlyStopping",
                 "init_args": {"monitor": "reward", "mode": "max", "stopping_threshold": -1.0e9,
                               "check_on_train_epoch_end": True}},
                {"class_path": "tests.e2e.test_callback_metrics.RecordStepMetrics"},
            ],
        },
        "model": {"model": make_model_dir(tmp_path / "model"), "learning_rate": 1e-2, "save_final_model": False},
        "data": {"dataset": write_prompts(tmp_path / "p.jsonl", num_rows=8), "reward_funcs": ["tests.helpers.length_reward"],
                 "num_generations": 4, "per_device_train_batch_size": 8,
                 "generation": {"max_completion_length": 6}},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = run_cli(["fit", "--config", str(path)])
    trainer = cli.trainer
    assert trainer.global_step == 4  # one epoch of 8 prompts, 2 per step: EarlyStopping ended the run
    recorder = next(c for c in trainer.callbacks if isinstance(c, RecordStepMetrics))
    assert len(recorder.steps) == 4
    expected = {"reward", "loss", "grad_norm", "learning_rate", "step_time", "entropy", "completions/mean_length",
                "rewards/length_reward/mean", "frac_reward_zero_std", "num_tokens"}
    assert expected <= set(recorder.steps[0])
    lengths = [step["completions/mean_length"] for step in recorder.steps]
    assert len(set(lengths)) > 1, "each step must carry its own value, not a stale one"
    checkpoint = trainer.checkpoint_callback
    assert float(checkpoint.best_model_score) == pytest.approx(max(lengths))
    assert checkpoint.best_model_path.endswith("best.ckpt")


def test_entropy_coef_is_a_step_metric_when_the_bonus_is_on(tmp_path):
    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import length_reward

    recorder = RecordStepMetrics()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[recorder],
                         default_root_dir=str(tmp_path))
    module = GRPOModule(make_model_dir(tmp_path / "m"), entropy_coef=0.05, save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    trainer.fit(module, data)
    assert [step["entropy_coef"] for step in recorder.steps] == pytest.approx([0.05, 0.05])
    assert "policy_loss" in recorder.steps[0]  # the loss before the bonus, logged when it is on

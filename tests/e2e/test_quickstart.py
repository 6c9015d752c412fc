"""The embedded default config trains, logs to MLflow, and its reward rises."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_reward_rises(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(REPO)  # the config uses repo-relative paths, as `make demo` does
    run_dir = tmp_path / "run"
    status = main(["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "60",
                   "--trainer.default_root_dir", str(run_dir), "--trainer.enable_progress_bar", "false"])
    assert status is None  # the `grpo` console script exits with sys.exit(main()): status 0
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    rewards = [m.value for m in client.get_metric_history(run.info.run_id, "reward")]
    assert len(rewards) == 12  # every 5 optimizer steps
    assert rewards[-1] > rewards[0] + 0.15, rewards
    assert (run_dir / "final_model" / "model.safetensors").exists()



class ClippedNorm(pl.Callback):
    """Records (norm measured before clipping, norm of the gradients the optimizer steps with)."""

    norms: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # grads kept until the next step
        grads = [p.grad for p in pl_module.policy.parameters() if p.grad is not None]
        self.norms.append((pl_module.step_metrics["grad_norm"], float(torch.stack([g.norm() for g in grads]).norm())))


@pytest.mark.slow
def test_quickstart_trains_under_bf16_mixed_with_gradient_clipping(tmp_path, monkeypatch):
    """The shipped GPU configs use bf16-mixed with TRL's max_grad_norm=1.0. Lightning's AMP
    plugin refuses to clip a fused optimizer's gradients; the module clips by the global norm it
    measured instead. A clip value far below the norm makes the clipping visible."""
    from grpo_lightning.cli import run_cli

    monkeypatch.chdir(REPO)
    ClippedNorm.norms = []
    cli = run_cli(["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "3",
                   "--trainer.precision", "bf16-mixed", "--trainer.gradient_clip_val", "0.01",
                   "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.enable_progress_bar", "false",
                   "--trainer.logger", "false", "--model.save_final_model", "false",
                   "--trainer.callbacks+=tests.e2e.test_quickstart.ClippedNorm"])
    assert cli.trainer.global_step == 3
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"]
    assert len(ClippedNorm.norms) == 3
    for before, after in ClippedNorm.norms:
        assert math.isfinite(before) and before > 0.01
        assert after == pytest.approx(0.01, rel=1e-3)  # clipped to gradient_clip_val

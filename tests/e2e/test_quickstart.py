"""The embedded default config trains, logs to MLflow, and its reward rises."""

from __future__ import annotations

from pathlib import Path

import pytest

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

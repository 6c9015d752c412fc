"""Two real processes (DDP over gloo on CPU): rewards are gathered, groups may straddle ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import free_port, make_model_dir, write_prompts

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("per_device_train_batch_size", [8, 6], ids=["whole-groups", "straddling-groups"])
def test_ddp_two_processes(tmp_path, per_device_train_batch_size):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    config = {
        "trainer": {"max_steps": 2, "accelerator": "cpu", "devices": 2, "strategy": "ddp",
                    "default_root_dir": str(run_dir), "log_every_n_steps": 1, "enable_progress_bar": False,
                    "enable_checkpointing": False},
        "model": {"model": make_model_dir(tmp_path / "model"), "learning_rate": 1e-2, "loss": "dapo"},
        "data": {"dataset": write_prompts(tmp_path / "p.jsonl"), "reward_funcs": ["tests.helpers.length_reward"],
                 "num_generations": 4, "per_device_train_batch_size": per_device_train_batch_size,
                 "generation": {"max_completion_length": 5}},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(free_port())}
    result = subprocess.run(
        [sys.executable, "-m", "grpo_lightning.cli", "fit", "--config", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    metrics = run.data.metrics
    assert {"reward", "loss", "entropy", "completions/mean_length", "num_tokens"} <= set(metrics)
    history = client.get_metric_history(run.info.run_id, "num_tokens")
    # 2 ranks x per-device rows x (6-token prompt + completion) per step, counted over both ranks
    assert history[0].value >= 2 * per_device_train_batch_size * 4

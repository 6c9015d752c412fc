"""Killed and resumed: a ``grpo fit`` run stopped with SIGKILL after a checkpoint and resumed with
``--ckpt_path last`` trains the same steps, prompts, completions, rewards, loss and learning rate
as a run that never stopped, in the same MLflow run. ``num_iterations: 2`` makes every other
checkpoint fall inside a generation batch (its rollouts are replayed from the checkpoint)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import make_model_dir, write_prompts

REPO = Path(__file__).resolve().parents[2]
STEPS = 12


def _config(tmp_path: Path, root: Path) -> Path:
    config = {
        "trainer": {"max_steps": STEPS, "accelerator": "cpu", "default_root_dir": str(root), "log_every_n_steps": 1,
                    "enable_progress_bar": False, "enable_model_summary": False,
                    "callbacks": [{"class_path": "grpo_lightning.callbacks.CompletionLogger",
                                   "init_args": {"every_n_steps": 1}}]},
        "model": {"model": str(tmp_path / "model"), "learning_rate": 2e-2, "lr_scheduler_type": "cosine",
                  "save_final_model": False},
        "data": {"dataset": str(tmp_path / "p.jsonl"), "reward_funcs": ["tests.helpers.length_reward"],
                 "num_generations": 4, "per_device_train_batch_size": 8, "num_iterations": 2,
                 "generation": {"max_completion_length": 6}},
        "checkpoint_every_n_steps": 3,
        "keep_checkpoints": 2,
    }
    path = root.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    return path


def _grpo(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "grpo_lightning.cli", "fit", "--config", str(config), *extra]


def _history(root: Path) -> tuple[dict[str, dict[int, float]], list]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    (run,) = runs
    out: dict[str, dict[int, float]] = {}
    for key in ("reward", "loss", "learning_rate", "completions/mean_length"):
        for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
            out.setdefault(key, {})[m.step] = m.value  # the last value logged for a step wins
    return out, runs


def _completions(root: Path) -> dict[str, list]:
    import pandas as pd

    tables = {}
    for path in sorted((root / "completions").glob("*.parquet")):
        frame = pd.read_parquet(path)
        tables[path.name] = frame[["prompt", "completion", "advantage"]].values.tolist()
    return tables


@pytest.mark.slow
def test_a_killed_run_resumes_exactly(tmp_path):
    make_model_dir(tmp_path / "model")
    write_prompts(tmp_path / "p.jsonl", num_rows=16)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    straight = tmp_path / "straight"
    done = subprocess.run(_grpo(_config(tmp_path, straight)), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    killed = tmp_path / "killed"
    config = _config(tmp_path, killed)
    process = subprocess.Popen(_grpo(config), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoint = killed / "checkpoints" / "step=0000006.ckpt"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert checkpoint.exists(), "the run ended before its step-6 checkpoint"
    resumed = subprocess.run(_grpo(config, "--ckpt_path", "last"), cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, _ = _history(straight)
    got, runs = _history(killed)  # exactly one MLflow run: the resume continued it
    assert runs[0].info.status == "FINISHED"
    assert sorted(expected["loss"]) == list(range(1, STEPS + 1))
    for key, values in expected.items():
        assert got[key] == values, key
    assert _completions(killed) == _completions(straight)
    kept = sorted(p.name for p in (killed / "checkpoints").glob("step=*.ckpt"))
    # keep_checkpoints: 2, plus the checkpoint the run resumed from (Lightning never deletes that one)
    assert kept == ["step=0000006.ckpt", "step=0000009.ckpt", "step=0000012.ckpt"]
    assert os.readlink(killed / "checkpoints" / "last.ckpt") == "step=0000012.ckpt"

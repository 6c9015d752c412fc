"""FSDP2 through ``grpo fit``: Lightning's ``ModelParallelStrategy`` (2 gloo processes on CPU; its
``fsdp``/``deepspeed`` strategies refuse CPU) from YAML, distributed (sharded) checkpoints in the
run folder, ``--ckpt_path last`` resuming one of them exactly, and a consolidated export that
``AutoModelForCausalLM`` loads."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import free_port, make_model_dir, write_prompts

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, name: str, max_steps: int) -> Path:
    config = {
        "trainer": {"max_steps": max_steps, "accelerator": "cpu", "devices": 2,
                    "strategy": {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                                 "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}},
                    "default_root_dir": str(tmp_path / name), "log_every_n_steps": 1, "enable_progress_bar": False},
        "model": {"model": str(tmp_path / "model"), "learning_rate": 1e-2},
        "data": {"dataset": str(tmp_path / "p.jsonl"), "reward_funcs": ["tests.helpers.length_reward"],
                 "num_generations": 4, "per_device_train_batch_size": 8, "generation": {"max_completion_length": 5}},
        "checkpoint_every_n_steps": 2,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _fit(config: Path, port: int, *extra: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(port)}
    result = subprocess.run([sys.executable, "-m", "grpo_lightning.cli", "fit", "--config", str(config), *extra],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]


def _metrics(root: Path) -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    out: dict[str, dict[int, float]] = {}
    for key in ("reward", "loss", "grad_norm", "learning_rate"):
        for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
            out.setdefault(key, {})[m.step] = m.value
    return out


@pytest.mark.slow
def test_fsdp2_from_yaml_checkpoints_resumes_and_exports(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    make_model_dir(tmp_path / "model")
    write_prompts(tmp_path / "p.jsonl", num_rows=16)
    _fit(_config(tmp_path, "straight", 4), free_port())
    resumed = _config(tmp_path, "resumed", 4)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(free_port())}
    process = subprocess.Popen([sys.executable, "-m", "grpo_lightning.cli", "fit", "--config", str(resumed)], cwd=REPO,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoint = tmp_path / "resumed" / "checkpoints" / "step=0000002.ckpt"
    deadline = time.monotonic() + 300
    while not (checkpoint / ".metadata").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the shards are written before the metadata; let the last write land
    os.killpg(process.pid, signal.SIGKILL)  # every rank of the job
    process.wait()
    assert checkpoint.is_dir() and (checkpoint / ".metadata").is_file()  # sharded: one file per rank
    assert len(list(checkpoint.glob("*.distcp"))) == 2
    # On a fast machine the tiny run can get past step 2 before the kill lands: drop what it wrote
    # after that checkpoint, so the resume always starts from step 2 (the kill being mid-run).
    for later in (tmp_path / "resumed" / "checkpoints").glob("step=*"):
        if later.name > checkpoint.name:
            shutil.rmtree(later)
    shutil.rmtree(tmp_path / "resumed" / "final_model", ignore_errors=True)
    _fit(resumed, free_port(), "--ckpt_path", "last")
    assert _metrics(tmp_path / "resumed") == _metrics(tmp_path / "straight")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "final_model")
    straight = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "final_model")
    for (name, a), (_, b) in zip(exported.state_dict().items(), straight.state_dict().items()):
        assert torch.equal(a, b), name  # the resumed run ends on the same weights

"""Two "nodes" of one process each on loopback, as a cluster launches them: torchrun (one
``torchrun --nnodes 2 --node_rank R`` per node) and SLURM (the variables ``srun`` sets for
``--nodes 2 --ntasks-per-node 1``), both running ``grpo fit --trainer.num_nodes 2``. The run
folder is shared, as on a cluster's shared filesystem."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import free_port, make_model_dir, write_prompts

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path) -> Path:
    config = {
        "trainer": {"max_steps": 2, "accelerator": "cpu", "num_nodes": 2, "devices": 1, "strategy": "ddp",
                    "default_root_dir": str(tmp_path / "run"), "log_every_n_steps": 1,
                    "enable_progress_bar": False},
        "model": {"model": make_model_dir(tmp_path / "model"), "learning_rate": 1e-2, "save_final_model": True},
        "data": {"dataset": write_prompts(tmp_path / "p.jsonl"), "reward_funcs": ["tests.helpers.length_reward"],
                 "num_generations": 4, "per_device_train_batch_size": 8, "generation": {"max_completion_length": 5}},
        "checkpoint_every_n_steps": 1,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _launch(commands: list[tuple[list[str], dict[str, str]]]) -> None:
    processes = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for cmd, env in commands]
    outputs = [p.communicate(timeout=400)[0] for p in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-4000:]


def _check_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])  # rank 0 logs, once
    tokens = client.get_metric_history(run.info.run_id, "num_tokens")
    assert tokens[0].value >= 2 * 8 * 6  # both nodes' rows counted (8 rows each, 6-token prompts)
    assert (run_dir / "checkpoints" / "last.ckpt").exists() and (run_dir / "final_model" / "config.json").exists()


@pytest.mark.slow
def test_two_nodes_under_torchrun(tmp_path):
    config, port = _config(tmp_path), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--master_addr", "127.0.0.1", "--master_port", str(port)]
    _launch([([*torchrun, "--node_rank", str(rank), "-m", "grpo_lightning.cli", "fit", "--config", str(config)], env)
             for rank in (0, 1)])
    _check_run(tmp_path)


@pytest.mark.slow
def test_two_nodes_under_slurm(tmp_path):
    config, port = _config(tmp_path), free_port()
    commands = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "grpo",
               "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "2", "SLURM_NODELIST": "127.0.0.1",
               "SLURM_NODEID": str(rank), "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0", "MASTER_PORT": str(port)}
        commands.append(([sys.executable, "-m", "grpo_lightning.cli", "fit", "--config", str(config)], env))
    _launch(commands)
    _check_run(tmp_path)

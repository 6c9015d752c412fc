"""Every shipped training recipe trains: two optimizer steps and an evaluation, under the
precision, sampler, loss, accumulation and callbacks it ships with.

What is swapped, and only that: a Hub model for a tiny local one (recipes whose model is in the
repository keep it), the GPU for the CPU (``bf16-mixed`` runs on CPU as it does on a GPU), the
Hub datasets for local files with their real columns (tests/test_configs.py), and the sizes that
make a step long (batch rows, completion length, steps, evaluation batches). The recipes in
``configs/agents`` train in tests/agents/test_agent_fit.py, ``configs/vlm`` in tests/vlm,
``configs/strategy`` (FSDP/DeepSpeed: CUDA only in Lightning) in tests/test_configs.py and
tests/module/test_deepspeed.py, ``configs/examples`` in tests/test_user_callbacks.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from tests.test_configs import offline_hub

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted([*REPO.glob("configs/*.yaml"), *REPO.glob("configs/gpu/*.yaml")])
CPU_PRECISIONS = {"32-true", "32", "bf16-mixed", "bf16-true", "64-true"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_recipe_trains_two_steps_and_evaluates(recipe, tmp_path, monkeypatch):
    from grpo_lightning.cli import run_cli
    from grpo_lightning.data import prompt_sets
    from tests.helpers import make_model_dir

    config = yaml.safe_load(recipe.read_text())
    trainer, model, data = config["trainer"], config["model"], config["data"]
    precision = str(trainer.get("precision", "32-true"))
    assert precision in CPU_PRECISIONS, f"{recipe.name}: {precision} does not run on CPU; swap it here explicitly"
    monkeypatch.setattr(prompt_sets, "load_prompt_dataset", offline_hub(tmp_path, rows=32))
    monkeypatch.chdir(REPO)  # recipes use repo-relative paths
    generations = data.get("num_generations", 8)
    args = ["fit", "--config", str(recipe),
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_steps", "2",
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.enable_progress_bar", "false",
            "--data.per_device_train_batch_size", str(2 * generations),
            "--data.generation.max_completion_length", "6"]
    if not (REPO / str(model["model"])).exists():  # a Hub model: a tiny local one in its place
        args += ["--model.model", make_model_dir(tmp_path / "model")]
    if "eval_dataset" in data:  # evaluate once, at the end of step 2
        args += ["--trainer.val_check_interval", str(2 * trainer.get("accumulate_grad_batches", 1)),
                 "--trainer.limit_val_batches", "1",
                 "--data.per_device_eval_batch_size", str(data.get("num_generations_eval") or generations)]
    cli = run_cli(args)

    assert cli.trainer.global_step == 2
    assert str(cli.trainer.precision) == precision  # the recipe's precision, not a test default
    metrics = cli.model.step_metrics
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]), metrics
    if "eval_dataset" in data:
        assert "eval_reward" in cli.trainer.callback_metrics
    if model.get("save_final_model", True):
        assert (tmp_path / "run" / "final_model" / "config.json").exists()

"""Evaluation: Lightning's validation loop drives the sampler and rewards; eval_* metrics."""

from __future__ import annotations

import pytest
import yaml

from grpo_lightning.cli import main
from tests.helpers import make_model_dir, write_prompts


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    return {
        "model": make_model_dir(root / "model"),
        "train": write_prompts(root / "train.jsonl", num_rows=16),
        "test": write_prompts(root / "test.jsonl", num_rows=5),
        "root": root,
    }


def write_config(setup, tmp_path, **data):
    config = {
        "trainer": {"max_steps": 4, "accelerator": "cpu", "default_root_dir": str(tmp_path / "run"),
                    "log_every_n_steps": 1, "enable_progress_bar": False, "val_check_interval": 2,
                    "enable_checkpointing": False},
        "model": {"model": setup["model"], "learning_rate": 1e-2},
        "data": {"dataset": setup["train"], "reward_funcs": ["tests.helpers.length_reward"], "num_generations": 4,
                 "per_device_train_batch_size": 8, "generation": {"max_completion_length": 4},
                 "per_device_eval_batch_size": 4, "num_generations_eval": 2, **data},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def history(run_dir, name):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)], run


@pytest.mark.slow
def test_in_fit_evaluation_logs_eval_metrics(setup, tmp_path):
    main(["fit", "--config", str(write_config(setup, tmp_path, eval_dataset=setup["test"]))])
    rewards, run = history(tmp_path / "run", "eval_reward")
    assert [step for step, _ in rewards] == [2, 4]  # val_check_interval=2 micro-steps
    for name in ["eval_loss", "eval_reward_std", "eval_completions/mean_length", "eval_rewards/length_reward/mean",
                 "eval_entropy", "reward"]:
        assert name in run.data.metrics, name


@pytest.mark.slow
def test_grpo_validate_and_named_eval_sets(setup, tmp_path, capsys):
    config = write_config(setup, tmp_path, eval_dataset={"easy": setup["test"], "all": setup["train"]})
    main(["validate", "--config", str(config)])
    printed = capsys.readouterr().out  # Lightning's results table, as after any `trainer.validate`
    assert "eval_easy_reward" in printed and "eval_all_loss" in printed, printed
    rewards, run = history(tmp_path / "run", "eval_easy_reward")
    assert len(rewards) == 1
    assert "eval_all_reward" in run.data.metrics and "eval_all_completions/mean_length" in run.data.metrics


def test_validate_without_eval_dataset_is_a_clear_error(setup, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # a user error: one message, no traceback
        main(["validate", "--config", str(write_config(setup, tmp_path))])
    assert exit_info.value.code == 1 and "data.eval_dataset" in capsys.readouterr().err


@pytest.mark.slow
def test_evaluation_leaves_the_training_trajectory_unchanged(setup, tmp_path):
    """Evaluation samples from its own seeded RNG stream: the training run with evaluation every
    2 steps trains on the same completions (same rewards and losses) as the one without."""
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    main(["fit", "--config", str(write_config(setup, tmp_path / "with", eval_dataset=setup["test"]))])
    main(["fit", "--config", str(write_config(setup, tmp_path / "without"))])
    for name in ("loss", "reward", "completions/mean_length"):
        with_eval, _ = history(tmp_path / "with" / "run", name)
        without_eval, _ = history(tmp_path / "without" / "run", name)
        assert with_eval == without_eval, name

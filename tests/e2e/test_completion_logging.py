"""log_extra columns reach the completion table; log_metric values and None rewards are logged."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from grpo_lightning.cli import main
from tests.helpers import make_model_dir, write_prompts
from tests.numerics import assert_close_f32


@pytest.mark.slow
def test_completion_table_metrics_and_multi_task_rewards(tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    config = {
        "trainer": {"max_steps": 2, "accelerator": "cpu", "default_root_dir": str(run_dir), "log_every_n_steps": 1,
                    "enable_progress_bar": False, "enable_checkpointing": False,
                    "callbacks": [{"class_path": "grpo_lightning.callbacks.CompletionLogger",
                                   "init_args": {"num_completions_to_print": 2}}]},
        "model": {"model": make_model_dir(tmp_path / "model"), "learning_rate": 1e-2},
        "data": {"dataset": write_prompts(tmp_path / "p.jsonl"),
                 "reward_funcs": ["tests.helpers.length_reward_with_extras", "tests.helpers.none_for_odd_answers"],
                 "num_generations": 4, "per_device_train_batch_size": 16, "shuffle_dataset": False,
                 "generation": {"max_completion_length": 4}},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(path)])

    table = pd.read_parquet(run_dir / "completions" / "completions_00001.parquet")
    assert {"prompt", "completion", "advantage", "num_chars", "reward/length_reward_with_extras",
            "reward/none_for_odd_answers"} <= set(table.columns)
    assert len(table) == 16
    assert (table["num_chars"] == table["completion"].str.len()).all()
    odd = table["prompt"].map(lambda p: sum(map(int, p.rstrip("=").split("+"))) % 2 == 1)
    assert table.loc[odd, "reward/none_for_odd_answers"].isna().all()
    assert table.loc[~odd, "reward/none_for_odd_answers"].notna().all()

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    experiment = client.get_experiment_by_name("grpo")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.metrics["my_metric"] == 3.0
    assert run.data.metrics["frac_reward_none"] == 0.0  # the first reward applies to every row
    # per-function means over the applicable rows only
    applicable = table.loc[~odd, "reward/none_for_odd_answers"]
    history = client.get_metric_history(run.info.run_id, "rewards/none_for_odd_answers/mean")
    assert history[0].step == 1
    # the logged mean of the applicable rows' (non-negative) rewards, to float32 rounding (tests/numerics.py)
    assert_close_f32(history[0].value, float(applicable.mean()), reduction_size=len(applicable))
    logged = client.load_table(experiment.experiment_id, "completions/completions_00002.json", [run.info.run_id])
    assert "num_chars" in logged.columns and len(logged) == 16


def test_a_reward_that_never_applies_is_warned_about_and_counted(tmp_path, caplog):
    import logging

    import lightning.pytorch as pl

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import length_reward

    def never_applies(completions, **kwargs):
        return [None] * len(completions)

    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward, never_applies],
                             num_generations=4, per_device_train_batch_size=8,
                             generation=GenerationParams(max_completion_length=3))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    with caplog.at_level(logging.WARNING, logger="grpo_lightning"):
        trainer.fit(GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False), data)
    assert "'never_applies' returned None" in caplog.text
    batch = data.buffer.batches[0]
    assert batch.generation_metrics["rewards/never_applies/frac_none"] == 1.0
    assert batch.generation_metrics["frac_reward_none"] == 0.0

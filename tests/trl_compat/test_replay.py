"""Item 3 of #14: a ``GRPOTrainer`` run written with ``to_yaml()`` and replayed with ``grpo fit``
logs the same metrics at every step, bit for bit (same config through the same CLI)."""

from __future__ import annotations

import pytest
import yaml

from grpo_lightning import GRPOConfig, GRPOTrainer, config_to_yaml
from grpo_lightning.cli import main
from tests.trl_compat.rewards import digit_reward, length_reward


def metric_histories(run_dir) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    return {name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
            for name in run.data.metrics}


@pytest.mark.slow
def test_facade_run_replayed_by_grpo_fit_logs_the_same_steps(tiny_model, prompts, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "facade"), max_steps=3, logging_steps=1, learning_rate=5e-3,
                      num_generations=4, per_device_train_batch_size=8, max_completion_length=6, report_to="mlflow",
                      gradient_accumulation_steps=2, beta=0.04, loss_type="grpo", save_strategy="no", seed=7)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[length_reward, digit_reward], args=args,
                          train_dataset=prompts)
    path = tmp_path / "replay.yaml"
    trainer.to_yaml(path)
    assert config_to_yaml(args, model=tiny_model, reward_funcs=[length_reward, digit_reward],
                          train_dataset=prompts) == path.read_text()  # same file without building a trainer
    trainer.train()

    main(["fit", "--config", str(path), "--trainer.default_root_dir", str(tmp_path / "replay")])

    facade, replay = metric_histories(tmp_path / "facade"), metric_histories(tmp_path / "replay")
    # train()'s summary is the facade's own (transformers logs it to the tracker too); grpo fit has none
    summary = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}
    assert summary <= set(facade) and [s for s, _ in facade["train_runtime"]] == [3]
    facade = {name: values for name, values in facade.items() if name not in summary}
    assert set(facade) == set(replay)
    timing = {"step_time"}
    for name in sorted(set(facade) - timing):
        assert facade[name] == replay[name], name  # exact: same config, same seeds, same code path
    assert [s for s, _ in facade["loss"]] == [1, 2, 3]
    # the facade's own record of the run holds the same values
    logged = [entry for entry in trainer.log_history if "loss" in entry]
    assert [(e["step"], e["loss"]) for e in logged] == [(s, pytest.approx(v, rel=1e-6)) for s, v in facade["loss"]]
    assert yaml.safe_load(path.read_text())["data"]["reward_funcs"] == [
        "tests.trl_compat.rewards.length_reward", "tests.trl_compat.rewards.digit_reward"]

"""The saved ``config.yaml`` records what ran (every knob of the loss and the sampler) and re-runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from grpo_lightning.cli import main

REPO = Path(__file__).resolve().parents[2]
QUICK = ["--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
         "--data.per_device_train_batch_size", "16"]


@pytest.mark.slow
def test_saved_quickstart_config_lists_every_knob_and_reruns(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(REPO)  # the quickstart uses repo-relative paths, as `make demo` does
    first = tmp_path / "first"
    main(["fit", "--config", "configs/quickstart.yaml", "--trainer.default_root_dir", str(first), *QUICK])
    saved = yaml.safe_load((first / "config.yaml").read_text())
    loss = saved["model"]["loss"]  # `loss: dapo` in the quickstart
    assert loss["class_path"] == "grpo_lightning.losses.DAPOLoss"
    assert {"epsilon": 0.2, "beta": 0.0, "epsilon_high": None}.items() <= loss["init_args"].items()
    assert saved["data"]["sampler"]["init_args"] == {"cache_implementation": None, "max_batch_rows": None,
                                                  "cache_weight_casts": True}
    assert saved["trainer"]["logger"] is None  # the default MLflow store follows default_root_dir on a re-run

    second = tmp_path / "second"
    main(["fit", "--config", str(first / "config.yaml"), "--trainer.default_root_dir", str(second)])
    rerun = yaml.safe_load((second / "config.yaml").read_text())
    assert rerun["model"] == saved["model"] and rerun["data"] == saved["data"]
    client = MlflowClient(f"sqlite:///{second}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    assert run.data.params["config/model.loss.init_args.epsilon"] == "0.2"
    assert run.data.params["config/model.loss.init_args.beta"] == "0.0"
    assert (second / "final_model" / "model.safetensors").exists()

"""log_multimodal: each row's image in the MLflow completion table, switchable off."""

from __future__ import annotations

import pandas as pd
import pytest

from grpo_lightning.callbacks import CompletionLogger
from tests.vlm.test_vlm_training import fit


@pytest.mark.slow
@pytest.mark.parametrize("log_multimodal", [True, False])
def test_images_in_the_mlflow_completion_table(tmp_path, qwen_processor, log_multimodal):
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name="vlm", tracking_uri=uri, artifact_location=str(tmp_path / "artifacts"))
    completions = CompletionLogger(every_n_steps=1, num_completions_to_print=0, log_multimodal=log_multimodal)
    fit(tmp_path, qwen_processor, max_steps=1, callbacks=[completions], logger=logger)

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("vlm")
    logged = client.load_table(experiment.experiment_id, "completions/completions_00001.json", [logger.run_id])
    assert len(logged) == 4
    artifacts = [a.path for a in client.list_artifacts(logger.run_id)]
    if log_multimodal:
        assert "image" in logged.columns and "table_images" in artifacts
    else:
        assert "image" not in logged.columns and "table_images" not in artifacts
    parquet = pd.read_parquet(tmp_path / "completions" / "completions_00001.parquet")
    assert "image" not in parquet.columns and len(parquet) == 4

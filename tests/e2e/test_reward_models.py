"""A run mixing a reward model (a path) with a reward function, configured from YAML."""

from __future__ import annotations

import pytest
import yaml

from grpo_lightning.cli import main
from grpo_lightning.utils.tiny_models import build_char_tokenizer
from tests.helpers import ALPHABET, make_model_dir, write_prompts


def make_reward_model_dir(path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = build_char_tokenizer(ALPHABET)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_reward_model_and_function_together(tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    config = {
        "trainer": {"max_steps": 2, "accelerator": "cpu", "default_root_dir": str(run_dir), "log_every_n_steps": 1,
                    "enable_progress_bar": False, "enable_checkpointing": False},
        "model": {"model": make_model_dir(tmp_path / "policy"), "learning_rate": 1e-2},
        "data": {"dataset": write_prompts(tmp_path / "p.jsonl"),
                 "reward_funcs": [make_reward_model_dir(tmp_path / "tiny-rm"), "tests.helpers.length_reward"],
                 "reward_weights": [1.0, 0.1], "num_generations": 4, "per_device_train_batch_size": 8,
                 "generation": {"max_completion_length": 4}},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(path)])
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    assert {"rewards/tiny-rm/mean", "rewards/tiny-rm/std", "rewards/length_reward/mean"} <= set(run.data.metrics)

"""``GRPOConfig``: transformers 5's ``activation_checkpointing(_kwargs)`` names, and the read-only
``TrainingArguments`` properties callbacks read, computed from the launcher's environment."""

from __future__ import annotations

import json

import pytest

from grpo_lightning.trl_compat import GRPOConfig


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)


def test_activation_checkpointing_names_are_accepted_for_gradient_checkpointing():
    config = GRPOConfig(activation_checkpointing=False, activation_checkpointing_kwargs={"use_reentrant": False})
    assert config.gradient_checkpointing is False and config.activation_checkpointing is False
    assert config.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert config.activation_checkpointing_kwargs == {"use_reentrant": False}
    # both given: the new name wins (transformers reads the deprecated one only when the new one is unset)
    assert GRPOConfig(activation_checkpointing=False, gradient_checkpointing=True).gradient_checkpointing is False
    assert GRPOConfig(activation_checkpointing=None, gradient_checkpointing=False).gradient_checkpointing is False
    assert GRPOConfig().activation_checkpointing is True  # TRL's default
    config.activation_checkpointing = True
    assert config.gradient_checkpointing is True


def test_process_properties_without_a_launcher():
    config = GRPOConfig(per_device_train_batch_size=4, num_generations=4, per_device_eval_batch_size=8,
                        use_cpu=True)
    assert (config.world_size, config.process_index, config.local_process_index) == (1, 0, 0)
    assert config.should_log and config.should_save
    assert config.n_gpu == 0 and str(config.device) == "cpu"
    assert (config.train_batch_size, config.eval_batch_size) == (4, 8)  # x max(1, n_gpu)


def test_process_properties_read_the_launchers_environment(monkeypatch):
    on_each_node = GRPOConfig(use_cpu=True)  # log_on_each_node=True, save_on_each_node=False
    main_only = GRPOConfig(use_cpu=True, log_on_each_node=False, save_on_each_node=True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")  # the main process of the second node
    assert (on_each_node.world_size, on_each_node.process_index, on_each_node.local_process_index) == (4, 2, 0)
    assert on_each_node.should_log and not on_each_node.should_save
    assert not main_only.should_log and main_only.should_save
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert GRPOConfig(use_cpu=False).n_gpu == 1  # distributed: one GPU per process, as transformers counts
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert GRPOConfig(use_cpu=False).n_gpu == 0


def test_to_json_string_and_to_sanitized_dict():
    config = GRPOConfig(output_dir="out", per_device_train_batch_size=4, num_generations=4, use_cpu=True,
                        hub_token="secret")
    assert json.loads(config.to_json_string()) == json.loads(json.dumps(config.to_dict(), default=str))
    assert json.loads(config.to_json_string())["hub_token"] == "<HUB_TOKEN>"
    sanitized = config.to_sanitized_dict()
    assert sanitized["train_batch_size"] == 4 and sanitized["learning_rate"] == 1e-6
    assert sanitized["report_to"] == "none" and sanitized["include_for_metrics"] == "[]"  # a list: its str
    assert all(type(v) in (bool, int, float, str) for v in sanitized.values())

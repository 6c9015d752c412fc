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


SETTER_CALLS = [
    ("set_training", {"learning_rate": 3e-4, "batch_size": 4, "weight_decay": 0.1, "num_epochs": 2, "max_steps": 9,
                      "gradient_accumulation_steps": 2, "seed": 5}),
    ("set_evaluate", {"strategy": "steps", "steps": 7, "batch_size": 4, "accumulation_steps": 2, "delay": 1.0}),
    ("set_testing", {"batch_size": 2, "loss_only": True}),
    ("set_save", {"strategy": "steps", "steps": 11, "total_limit": 3, "on_each_node": True}),
    ("set_logging", {"strategy": "steps", "steps": 3, "report_to": "mlflow", "level": "info", "first_step": True,
                     "nan_inf_filter": True, "on_each_node": True, "replica_level": "warning"}),
    ("set_push_to_hub", {"model_id": "me/model", "strategy": "end", "token": "t", "private_repo": True,
                         "always_push": True, "revision": "dev"}),
    ("set_optimizer", {"name": "sgd", "learning_rate": 1e-3, "weight_decay": 0.2, "beta1": 0.8, "beta2": 0.9,
                       "epsilon": 1e-6, "args": "momentum=0.9"}),
    ("set_lr_scheduler", {"name": "cosine", "num_epochs": 2.0, "max_steps": 20, "warmup_steps": 0.1}),
    ("set_dataloader", {"train_batch_size": 4, "eval_batch_size": 2, "drop_last": True, "num_workers": 1,
                        "pin_memory": False, "persistent_workers": True, "prefetch_factor": 2, "in_order": False,
                        "auto_find_batch_size": True, "ignore_data_skip": True, "sampler_seed": 3}),
]


@pytest.mark.parametrize("setter, kwargs", SETTER_CALLS, ids=[call[0] for call in SETTER_CALLS])
def test_setters_set_what_transformers_sets(setter, kwargs, tmp_path):
    """Each ``set_*`` leaves every field it touches as transformers' own ``TrainingArguments`` does."""
    from transformers import TrainingArguments

    def value(v):
        return getattr(v, "value", v)  # transformers' enums as their strings

    if setter == "set_training":  # transformers 5.17 names it gradient_checkpointing only; ours takes both names
        import inspect

        takes_new_name = "activation_checkpointing" in inspect.signature(TrainingArguments.set_training).parameters
        kwargs = {**kwargs, ("activation_checkpointing" if takes_new_name else "gradient_checkpointing"): True}
    theirs = TrainingArguments(output_dir=str(tmp_path))
    ours = GRPOConfig(output_dir=str(tmp_path))
    their_before, our_before = dict(vars(theirs)), dict(vars(ours))
    assert getattr(theirs, setter)(**kwargs) is theirs and getattr(ours, setter)(**kwargs) is ours
    touched = {k for k, v in vars(theirs).items() if their_before.get(k) != v}
    touched |= {k for k, v in vars(ours).items() if our_before.get(k) != v}
    assert touched
    for name in sorted(touched):
        assert value(getattr(ours, name)) == value(getattr(theirs, name)), name


def test_setters_check_strategies_as_transformers_does():
    with pytest.raises(ValueError, match="requires a positive value for `steps`"):
        GRPOConfig().set_save(strategy="steps", steps=0)
    with pytest.raises(ValueError, match="hourly is not a valid IntervalStrategy"):
        GRPOConfig().set_logging(strategy="hourly")


def test_parallel_mode(monkeypatch):
    from transformers.training_args import ParallelMode

    assert GRPOConfig(use_cpu=True).parallel_mode is ParallelMode.NOT_PARALLEL
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert GRPOConfig(use_cpu=True).parallel_mode is ParallelMode.DISTRIBUTED

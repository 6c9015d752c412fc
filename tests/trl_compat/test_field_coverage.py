"""Every field of the seed's ``GRPOConfig`` is read by one converter or has a reason it does not
apply; every YAML key of ``FIELD_TO_YAML`` exists in the ``grpo fit`` parser; converted configs
parse; values convert as documented; set fields without a home are reported or refused."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings

import pytest
import yaml

from grpo_lightning import GRPOConfig, config_to_yaml
from grpo_lightning.errors import ConfigError
from grpo_lightning.trl_compat.builder import ReplayError
from grpo_lightning.trl_compat.config import FIELD_NAMES
from grpo_lightning.trl_compat.convert import CONVERTED, FACADE_FIELDS, READ_TO_REFUSE, REFUSED_WHEN_SET
from grpo_lightning.trl_compat.field_map import FIELD_TO_YAML, not_applicable_reason, pending_key, yaml_key


@pytest.fixture(scope="module")
def fit_parser():
    """The parser of ``grpo fit`` (built as the CLI builds it, nothing parsed or instantiated)."""
    from grpo_lightning.cli import TRAINER_DEFAULTS, GRPOLightningCLI
    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule

    class Built(Exception):
        pass

    class ParserOnly(GRPOLightningCLI):
        def parse_arguments(self, parser, args):
            raise Built(parser)

    with pytest.raises(Built) as built:
        ParserOnly(GRPOModule, RolloutDataModule, trainer_defaults=TRAINER_DEFAULTS, seed_everything_default=42,
                   args=[], auto_configure_optimizers=False)
    return built.value.args[0]._subcommands_action._name_parser_map["fit"]


def test_every_field_is_converted_or_not_applicable():
    """A field with a key (or a pending one) is read by a converter; one without is not (except the
    few read only to refuse a value); the trainer's own fields and the refused ones have no key."""
    assert set(FIELD_TO_YAML) == set(FIELD_NAMES)
    for name in FIELD_NAMES:
        has_home = yaml_key(name) is not None or pending_key(name) is not None
        assert (name in CONVERTED) == (has_home or name in READ_TO_REFUSE), name
    assert set(FACADE_FIELDS) | set(REFUSED_WHEN_SET) | set(READ_TO_REFUSE) <= {
        n for n in FIELD_NAMES if not_applicable_reason(n)}


def test_a_pending_field_is_refused_when_set(tmp_path):
    for name, value in (("use_liger_kernel", True), ("pad_to_multiple_of", 64)):
        assert pending_key(name)
        with pytest.raises(ConfigError, match=f"{name}=.* is not supported yet"):
            _yaml(output_dir=str(tmp_path), **{name: value})


def _class_named(name: str, modules: tuple[str, ...]) -> type:
    for module in modules:
        cls = getattr(importlib.import_module(module), name, None)
        if cls is not None:
            return cls
    raise AssertionError(f"no class {name} in {modules}")


def _params(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def resolves(key: str, defaults: dict) -> bool:
    """Whether ``key`` names a setting of ``grpo fit`` (``defaults``: the parser's flattened defaults)."""
    from grpo_lightning.agents import AgentSettings
    from grpo_lightning.losses import LOSSES
    from grpo_lightning.samplers import SAMPLERS

    head, _, rest = key.partition("[")
    if rest:  # section[Class].init_args.param
        cls_name, _, tail = rest.partition("]")
        if head == "trainer.callbacks":
            cls = _class_named(cls_name, ("grpo_lightning.callbacks", "lightning.pytorch.callbacks"))
        else:
            assert head == "data.sampler", key
            paths = {p.rsplit(".", 1)[1]: p for p in SAMPLERS.values()}
            cls = getattr(importlib.import_module(paths[cls_name].rsplit(".", 1)[0]), cls_name)
        return not tail or tail.removeprefix(".init_args.") in _params(cls)
    if key.startswith("model.loss.init_args."):
        return any(key.rsplit(".", 1)[1] in _params(cls) for cls in LOSSES.values())
    if key.startswith("data.sampler.init_args."):
        name = key.rsplit(".", 1)[1]
        return any(name in _params(_load(path)) for path in SAMPLERS.values())
    if key.startswith("data.agent."):
        return key.rsplit(".", 1)[1] in _params(AgentSettings)
    return key in defaults or any(k.startswith(key + ".") for k in defaults)


def _load(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_yaml_key_resolves_in_the_cli_parser(fit_parser):
    defaults = fit_parser.get_defaults()
    flat = set(defaults.keys())
    keys = {yaml_key(name) for name in FIELD_TO_YAML} - {None}
    missing = sorted(key for key in keys if not resolves(key, flat))
    assert not missing, f"FIELD_TO_YAML keys that grpo fit does not have: {missing}"
    pending = sorted(pending_key(n) for n in FIELD_TO_YAML if pending_key(n) and resolves(pending_key(n), flat))
    assert not pending, f"keys marked pending that grpo fit has now (map them in FIELD_TO_YAML): {pending}"


CONFIGS = {
    "defaults": {},
    "vllm server + callbacks": dict(use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.1", sync_ref_model=True,
                                    beta=0.04, use_adaptive_entropy=True, log_completions=True, loss_type="sapo",
                                    report_to="tensorboard", optim="sgd", optim_args="momentum=0.9", warmup_steps=0.1,
                                    max_steps=20, save_total_limit=3, fp16=True, data_seed=3),
    "colocate + evaluation": dict(use_vllm=True, eval_strategy="steps", eval_steps=5, gradient_accumulation_steps=2,
                                  max_steps=50, lr_scheduler_type="cosine", adam_beta2=0.99, bf16=False),
    "continuous batching": dict(use_transformers_continuous_batching=True, num_train_epochs=2, save_strategy="no",
                                transformers_continuous_batching_config={"max_memory_percent": 0.4}),
}


@pytest.mark.parametrize("kwargs", CONFIGS.values(), ids=CONFIGS)
def test_converted_configs_parse_in_grpo_fit(kwargs, fit_parser, tmp_path):
    eval_set = {"eval_dataset": _dataset()} if kwargs.get("eval_strategy") else {}
    text = config_to_yaml(GRPOConfig(output_dir=str(tmp_path), **kwargs), model="org/model",
                          reward_funcs="tests.trl_compat.rewards.length_reward", train_dataset=_dataset(), **eval_set)
    config = yaml.safe_load(text)
    fit_parser.parse_object(config)  # every key known, every value of its type (no model is loaded)


def _dataset():
    import datasets

    return datasets.Dataset.from_list([{"prompt": "1+1="}] * 8)


def _yaml(**kwargs) -> dict:
    return yaml.safe_load(config_to_yaml(GRPOConfig(**kwargs)))


@pytest.mark.parametrize("kwargs, key, expected", [
    ({}, "trainer.precision", "bf16-mixed"),  # TRL: bf16 unless fp16
    ({"fp16": True}, "trainer.precision", "16-mixed"),
    ({"bf16": False}, "trainer.precision", "32-true"),
    ({}, "trainer.max_epochs", 3),
    ({"max_steps": 7}, "trainer.max_steps", 7),
    ({"max_grad_norm": 0.0}, "trainer.gradient_clip_val", None),
    ({"max_grad_norm": -1.0}, "trainer.gradient_clip_val", None),  # transformers: <= 0 skips clipping
    ({"logging_steps": 0.25, "max_steps": 10}, "trainer.log_every_n_steps", 3),
    ({}, "checkpoint_every_n_steps", 500),
    ({"save_strategy": "no"}, "trainer.enable_checkpointing", False),
    ({}, "trainer.logger", False),  # report_to="none"
    ({"report_to": "mlflow"}, "trainer.logger", None),  # the CLI's MLflow store
    ({"warmup_steps": 0.1}, "model.warmup_ratio", 0.1),
    ({"warmup_steps": 5}, "model.warmup_steps", 5),
    ({"optim": "adamw_torch", "adam_beta1": 0.8}, "model.optimizer", {
        "class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-6, "weight_decay": 0.0, "betas": [0.8, 0.999],
                                                         "eps": 1e-8}}),
    ({"loss_type": "cispo", "epsilon_high": 4.0}, "model.loss.init_args.epsilon_high", 4.0),
    ({"loss_type": "vespo"}, "model.loss.init_args.vespo_k_neg", 3.0),
    ({"gradient_accumulation_steps": 4, "steps_per_generation": 8}, "data.steps_per_generation", 8),
    ({"model_init_kwargs": {"dtype": "bfloat16", "revision": "v1"}}, "model.dtype", "bfloat16"),
    ({"model_init_kwargs": '{"revision": "v1"}'}, "model.model_init_kwargs", {"revision": "v1"}),
    ({"seed": 3}, "seed_everything", 3),
    ({"vllm_importance_sampling_cap": 2.0}, "data.importance_sampling.clip_max", 2.0),  # deprecated alias
    ({"chat_template_kwargs": {"enable_thinking": False}}, "data.chat_template_kwargs", {"enable_thinking": False}),
])
def test_values_convert_as_documented(kwargs, key, expected, tmp_path):
    value = _yaml(output_dir=str(tmp_path), **kwargs)
    for part in key.split("."):
        value = value[part]
    assert value == expected


def test_num_generations_eval_zero_means_num_generations(tmp_path):
    """TRL reads ``num_generations_eval or num_generations``: 0 leaves the datamodule's default."""
    assert "num_generations_eval" not in _yaml(output_dir=str(tmp_path), num_generations_eval=0)["data"]
    assert _yaml(output_dir=str(tmp_path), num_generations_eval=4)["data"]["num_generations_eval"] == 4


def test_eval_schedule_counts_micro_steps(tmp_path):
    text = config_to_yaml(GRPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=5,
                                     gradient_accumulation_steps=4), eval_dataset=_dataset())
    trainer = yaml.safe_load(text)["trainer"]
    assert trainer["val_check_interval"] == 20 and trainer["check_val_every_n_epoch"] is None
    text = config_to_yaml(GRPOConfig(output_dir=str(tmp_path)), eval_dataset=_dataset())
    assert yaml.safe_load(text)["trainer"]["limit_val_batches"] == 0  # eval_strategy="no": evaluate() only


def test_set_fields_without_a_home_are_reported_once(tmp_path):
    with pytest.warns(UserWarning, match=r"tf32=True .*torch_compile=True .*dataloader_num_workers=4") as record:
        _yaml(output_dir=str(tmp_path), tf32=True, torch_compile=True, dataloader_num_workers=4)
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _yaml(output_dir=str(tmp_path))  # defaults: nothing to report


@pytest.mark.parametrize("kwargs, match", [
    ({"neftune_noise_alpha": 5.0}, "NEFTune"),
    ({"average_tokens_across_devices": False}, "all ranks"),
    ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type='polynomial' is not supported"),
    ({"optim": "adamw_8bit"}, "optim='adamw_8bit' is not supported"),
    ({"num_train_epochs": 0.5}, "whole epochs"),
    ({"logging_strategy": "epoch"}, "logging_strategy"),
    ({"save_strategy": "epoch"}, "save_strategy='epoch'"),
    ({"report_to": "trackio"}, "report_to"),
    ({"fsdp": "full_shard"}, "trainer.strategy"),
    ({"eval_strategy": "steps"}, "needs an eval_dataset"),
])
def test_values_without_an_equivalent_are_refused(kwargs, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        _yaml(output_dir=str(tmp_path), **kwargs)


def test_best_model_at_end_is_refused_with_the_yaml_way(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), load_best_model_at_end=True, eval_strategy="steps", eval_steps=5,
                      save_steps=5)
    with pytest.raises(ConfigError, match="ModelCheckpoint"):
        config_to_yaml(args, eval_dataset=_dataset())


def test_replay_rule(tmp_path):
    import datasets

    def local_reward(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ReplayError) as refused:
        config_to_yaml(GRPOConfig(output_dir=str(tmp_path)),
                       reward_funcs=[lambda completions, **kw: [0.0] * len(completions), local_reward, "exact_match_reward"])
    assert "a lambda has no importable name" in str(refused.value)
    assert "local_reward is defined inside a function" in str(refused.value)

    stream = datasets.Dataset.from_list([{"prompt": f"{i}="} for i in range(100)]).to_iterable_dataset()
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=3, num_generations=4, per_device_train_batch_size=8)
    config = yaml.safe_load(config_to_yaml(args, train_dataset=stream, reward_funcs="exact_match_reward"))
    written = datasets.load_from_disk(config["data"]["dataset"])
    assert written["prompt"] == [f"{i}=" for i in range(6)]  # 3 steps x 2 prompts, in stream order
    assert config["data"]["shuffle_dataset"] is False
    with pytest.raises(ConfigError, match="pass one split"):
        config_to_yaml(args, train_dataset=datasets.DatasetDict({"train": _dataset()}))


def test_tokenizer_and_lora_objects_become_settings(tmp_path):
    from peft import LoraConfig

    from grpo_lightning.utils.tiny_models import build_char_tokenizer

    tokenizer = build_char_tokenizer("0123456789+=")
    config = yaml.safe_load(config_to_yaml(GRPOConfig(output_dir=str(tmp_path)), model="org/model",
                                           processing_class=tokenizer,
                                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])))
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(config["model"]["tokenizer"])
    assert saved("12+3=").input_ids == tokenizer("12+3=").input_ids
    lora = config["model"]["peft_config"]
    assert (lora["r"], lora["lora_alpha"], sorted(lora["target_modules"])) == (4, 8, ["q_proj", "v_proj"])


def test_hf_callback_classes_go_into_the_yaml_file(fit_parser, tmp_path):
    from grpo_lightning.trl_compat.callbacks import TrainerCallbacks
    from tests.trl_compat.rewards import StopAfterFirstStep

    args = GRPOConfig(output_dir=str(tmp_path), logging_steps=2)
    config = yaml.safe_load(config_to_yaml(args, model="org/model", callbacks=[StopAfterFirstStep]))
    flow, entry = config["trainer"]["callbacks"]  # every run's TRLStepFlow, then the HF callbacks
    assert flow == {"class_path": "grpo_lightning.trl_compat.flow.TRLStepFlow",
                    "init_args": {"evaluate_at_end": False, "log_first_step": False}}
    assert entry == {"class_path": "grpo_lightning.trl_compat.callbacks.TrainerCallbacks", "init_args": {
        "callbacks": ["tests.trl_compat.rewards.StopAfterFirstStep"], "args": {"output_dir": str(tmp_path),
                                                                            "logging_steps": 2}}}
    fit_parser.parse_object(config)
    built = TrainerCallbacks(**entry["init_args"])  # what grpo fit builds from it
    assert isinstance(built.callbacks[0], StopAfterFirstStep) and built.args.logging_steps == 2
    with pytest.raises(ReplayError, match="is an instance: pass its class"):
        config_to_yaml(args, callbacks=[StopAfterFirstStep()])

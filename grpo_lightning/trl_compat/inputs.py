"""``GRPOTrainer``'s arguments besides ``args`` as ``grpo fit`` settings.

The replay rule for objects (see also ``replay.py``):

* ``datasets.Dataset`` (train or eval) -> written with ``save_to_disk`` to
  ``<output_dir>/trl_inputs/<name>``, which ``data.dataset`` / ``data.eval_dataset`` name;
  an ``IterableDataset`` -> the rows the run reads (``max_steps`` generation batches' worth) written
  the same way, in stream order (TRL does not shuffle a stream);
* a tokenizer or processor object (``processing_class``, ``reward_processing_classes``) -> ``save_pretrained`` to
  ``<output_dir>/trl_inputs/<name>``;
* a ``peft.LoraConfig`` / ``BitsAndBytesConfig`` -> their settings (``model.peft_config``,
  ``model.quantization_config``);
* functions and classes (rewards, tools, environments, ``rollout_func``) -> their dotted path when
  importable, else kept in memory (the YAML export refuses them, naming each);
* a model object -> kept in memory (save it with ``save_pretrained`` and pass the folder to replay).

Layer L7 (trl_compat).
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
from typing import Any

from grpo_lightning.errors import ConfigError
from grpo_lightning.trl_compat.builder import ConfigBuilder, InMemory
from grpo_lightning.trl_compat.replay import by_path, in_memory_only

INPUTS_DIR = "trl_inputs"
LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save", "bias", "use_rslora", "use_dora",
               "init_lora_weights", "layers_to_transform", "exclude_modules")
QUANT_FIELDS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_compute_dtype",
                "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage", "llm_int8_skip_modules")


def inputs_dir(args: Any) -> str:
    return os.path.abspath(os.path.join(args.output_dir, INPUTS_DIR))


def model_entries(b: ConfigBuilder, args: Any, model: Any, processing_class: Any, peft_config: Any,
                  quantization_config: Any) -> None:
    if isinstance(model, str):
        b.set("model.model", model)
    else:
        b.set("model.model", in_memory_only(model, "model", "save it with save_pretrained and pass the folder's path",
                                            after_parse=True))
    if processing_class is not None:
        b.set("model.tokenizer", save_tokenizer(processing_class, args, "processing_class"))
    if peft_config is not None:
        b.set("model.peft_config", lora_settings(peft_config))
    if quantization_config is not None:
        b.set("model.quantization_config", _fields_of(quantization_config, QUANT_FIELDS, "quantization_config"))


def save_tokenizer(tokenizer: Any, args: Any, name: str) -> str:
    """A tokenizer object saved in the run folder (its path), or a path as given."""
    if isinstance(tokenizer, str):
        return tokenizer
    if not hasattr(tokenizer, "save_pretrained"):
        raise ConfigError(f"{name} is a {type(tokenizer).__name__}: give a transformers tokenizer or processor (or "
                          "its path).")
    folder = os.path.join(inputs_dir(args), name)
    shutil.rmtree(folder, ignore_errors=True)
    tokenizer.save_pretrained(folder)
    return folder


def lora_settings(config: Any) -> dict[str, Any]:
    """A ``peft.LoraConfig`` (or a dict of its fields) as ``model.peft_config``."""
    if isinstance(config, dict):
        return config
    kind = getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None))
    if kind != "LORA":
        raise ConfigError(f"peft_config is a {type(config).__name__} ({kind}): only LoRA adapters (peft.LoraConfig) "
                          "are supported.")
    out = _fields_of(config, LORA_FIELDS, "peft_config")
    if isinstance(out.get("target_modules"), (set, frozenset)):
        out["target_modules"] = sorted(out["target_modules"])
    if isinstance(out.get("exclude_modules"), (set, frozenset)):
        out["exclude_modules"] = sorted(out["exclude_modules"])
    return out


def _fields_of(obj: Any, names: tuple[str, ...], setting: str) -> dict[str, Any]:
    if isinstance(obj, dict):
        return dict(obj)
    out = {}
    for name in names:
        value = getattr(obj, name, None)
        if name.endswith(("_dtype", "_storage")) and value is not None and not isinstance(value, str):
            value = str(value).removeprefix("torch.")
        out[name] = value
    return {k: v for k, v in out.items() if v is not None or k in ("target_modules",)}


def reward_entries(b: ConfigBuilder, args: Any, reward_funcs: Any, reward_processing_classes: Any) -> None:
    funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    entries = []
    for i, func in enumerate(funcs):
        if isinstance(func, str) or callable(func) and not hasattr(func, "parameters"):
            entries.append(by_path(func, f"reward_funcs[{i}]"))
        else:  # a reward model object
            entries.append(in_memory_only(func, f"reward_funcs[{i}]", "save it with save_pretrained and pass its path"))
    if entries:
        b.set("data.reward_funcs", entries)
    if reward_processing_classes is not None:
        if isinstance(reward_processing_classes, (list, tuple)):
            value: Any = [None if t is None else save_tokenizer(t, args, f"reward_processing_class_{i}")
                          for i, t in enumerate(reward_processing_classes)]
        else:
            value = save_tokenizer(reward_processing_classes, args, "reward_processing_class")
        b.set("data.reward_processing_classes", value)


def dataset_entries(b: ConfigBuilder, args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    if train_dataset is not None:
        b.set("data.dataset", save_dataset(train_dataset, args, "train_dataset", rows=stream_rows(args)))
        if _is_iterable(train_dataset):
            b.set("data.shuffle_dataset", False)  # a stream is read in order (TRL)
    if eval_dataset is not None:
        if hasattr(eval_dataset, "items") and not hasattr(eval_dataset, "features"):  # dict / DatasetDict
            b.set("data.eval_dataset", {str(name): save_dataset(ds, args, f"eval_dataset_{name}")
                                        for name, ds in eval_dataset.items()})
        else:
            b.set("data.eval_dataset", save_dataset(eval_dataset, args, "eval_dataset"))


def _is_iterable(dataset: Any) -> bool:
    import datasets

    return isinstance(dataset, datasets.IterableDataset)


def stream_rows(args: Any) -> int | None:
    """Prompts ``max_steps`` optimizer steps read: whole generation batches of
    ``generation_batch_size / num_generations`` prompts, each covering ``steps_per_generation x
    num_iterations`` micro-steps (``gradient_accumulation_steps`` per optimizer step)."""
    if args.max_steps <= 0:
        return None
    micro_steps = args.max_steps * args.gradient_accumulation_steps
    batches = math.ceil(micro_steps / (args.steps_per_generation * args.num_iterations))
    return batches * (args.generation_batch_size // args.num_generations)


def save_dataset(dataset: Any, args: Any, name: str, rows: int | None = None) -> str:
    """``dataset`` written to ``<output_dir>/trl_inputs/<name>`` (``save_to_disk``); its path.

    A path or hub id (a string) is returned as given.
    """
    import datasets

    if isinstance(dataset, str):
        return dataset
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise ConfigError(f"{name} is a {type(dataset).__name__} (splits {list(dataset)}): pass one split, e.g. "
                          f"{name}=dataset['train'].")
    folder = os.path.join(inputs_dir(args), name)
    if isinstance(dataset, datasets.IterableDataset):
        if name == "train_dataset" and rows is None:
            raise ConfigError("train_dataset is an IterableDataset: set GRPOConfig.max_steps (its length is unknown; "
                              "TRL needs it too).")
        items = list(itertools.islice(dataset, rows)) if rows is not None else list(dataset)
        if not items:
            raise ConfigError(f"{name} (an IterableDataset) yielded no rows.")
        dataset = datasets.Dataset.from_list(items, features=dataset.features)
    if not isinstance(dataset, datasets.Dataset):
        raise ConfigError(f"{name} is a {type(dataset).__name__}: give a datasets.Dataset or IterableDataset (or a "
                          "path for grpo fit).")
    if any(os.path.abspath(f["filename"]).startswith(folder + os.sep) for f in dataset.cache_files):
        return folder  # the dataset was loaded from this very folder: already written
    shutil.rmtree(folder, ignore_errors=True)
    dataset.save_to_disk(folder)
    return folder


def agent_entries(b: ConfigBuilder, tools: Any, environment_factory: Any) -> None:
    if not tools and environment_factory is None:
        return
    agent: dict[str, Any] = {}
    if tools:
        agent["tools"] = [by_path(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if environment_factory is not None:
        if isinstance(environment_factory, dict):
            agent["environment_factory"] = {k: by_path(v, f"environment_factory[{k!r}]")
                                            for k, v in environment_factory.items()}
        else:
            agent["environment_factory"] = by_path(environment_factory, "environment_factory")
    b.set("data.agent", agent)


def rollout_entries(b: ConfigBuilder, rollout_func: Any) -> None:
    if rollout_func is None:
        return
    b.set("data.sampler", {"class_path": "grpo_lightning.samplers.rollout_func.RolloutFuncSampler",
                           "init_args": {"rollout_func": by_path(rollout_func, "rollout_func")}})


def is_in_memory(value: Any) -> bool:
    return isinstance(value, InMemory)

"""The ``TrainingArguments`` half of ``GRPOConfig`` as ``grpo fit`` settings.

Each converter reads the fields it names (``CONVERTERS``) and writes their YAML keys
(``field_map.FIELD_TO_YAML``); a value that has no equivalent is refused with a
:class:`~grpo_lightning.errors.ConfigError` naming the field and what to do instead.

Layer L7 (trl_compat): the standard library only.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Any, Callable

from grpo_lightning.errors import ConfigError
from grpo_lightning.trl_compat.builder import ConfigBuilder

#: ``lr_scheduler_type`` values ``model.lr_scheduler_type`` takes (the others are refused).
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
#: ``optim`` name -> (optimizer class, its name for betas/eps or None, extra init_args).
OPTIMIZERS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "adamw_torch_fused": ("torch.optim.AdamW", True, {"fused": True}),
    "adamw_torch": ("torch.optim.AdamW", True, {}),
    "adam": ("torch.optim.Adam", True, {}),
    "sgd": ("torch.optim.SGD", False, {}),
    "adagrad": ("torch.optim.Adagrad", False, {}),
    "rmsprop": ("torch.optim.RMSprop", False, {}),
    "adafactor": ("transformers.optimization.Adafactor", False, {"scale_parameter": False, "relative_step": False}),
}
#: ``report_to`` entries and the logger each becomes (``None``: the default MLflow store in the run folder).
LOGGERS = {
    "mlflow": None, "all": None,
    "tensorboard": "lightning.pytorch.loggers.TensorBoardLogger",
    "wandb": "lightning.pytorch.loggers.WandbLogger",
    "comet_ml": "lightning.pytorch.loggers.CometLogger",
    "neptune": "lightning.pytorch.loggers.NeptuneLogger",
}  # fmt: skip


@dataclass(frozen=True)
class Context:
    """What the conversion needs besides the config: the trainer's other arguments."""

    has_eval_dataset: bool = False
    optimizer_object: bool = False  # optimizers=(optimizer, ...) was given
    strategies: frozenset[str] = frozenset()  # extra strategy classes available (``deepspeed``)
    params: frozenset[str] = frozenset()  # ``model.<arg>`` / ``data.<arg>`` keys this version has


def _steps(c: Any, name: str, value: float) -> int:
    """A step count, or (below 1) a fraction of ``max_steps``, as transformers reads it. A fraction
    of an epoch run's steps is 1 here: ``TRLStepFlow`` resolves it once the data is set up
    (:func:`epoch_fraction`)."""
    if value >= 1:
        if value != int(value):
            raise ConfigError(f"GRPOConfig.{name}={value}: a step count above 1 must be a whole number.")
        return int(value)
    if c.max_steps <= 0:
        return 1
    return max(1, math.ceil(c.max_steps * value))


def epoch_fraction(c: Any, value: float | None) -> float | None:
    """``value`` when it is a fraction of a run bounded by ``num_train_epochs`` (its steps are known
    only once the data is set up), else ``None``."""
    return value if value is not None and 0 < value < 1 and c.max_steps <= 0 else None


def run_length(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    b.set("trainer.default_root_dir", c.output_dir)
    b.set("data.per_device_train_batch_size", c.per_device_train_batch_size)
    if c.max_steps > 0:
        b.set("trainer.max_steps", c.max_steps)  # wins over num_train_epochs (transformers); Lightning's
        return  # max_epochs default then means "until max_steps"
    epochs = c.num_train_epochs
    if epochs != int(epochs) or epochs < 1:
        raise ConfigError(f"GRPOConfig.num_train_epochs={epochs}: grpo-lightning trains whole epochs (at least 1); "
                          "set max_steps for a part of an epoch.")
    b.set("trainer.max_steps", -1)
    b.set("trainer.max_epochs", int(epochs))


def optimizer(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    """The default AdamW (``model.learning_rate``, ``model.weight_decay``) or ``model.optimizer``."""
    if c.optim_target_modules is not None:
        raise ConfigError(f"GRPOConfig.optim_target_modules={c.optim_target_modules!r}: optimizers restricted to some "
                          "modules (GaLore, APOLLO) are not supported; use a torch optimizer (model.optimizer).")
    name = getattr(c.optim, "value", c.optim)
    if name not in OPTIMIZERS:
        raise ConfigError(f"GRPOConfig.optim={name!r} is not supported: use one of {', '.join(OPTIMIZERS)}, or any "
                          "torch optimizer in YAML (model.optimizer: {class_path: ..., init_args: {...}}).")
    extra = _optim_args(c.optim_args)
    class_path, adam_like, fixed = OPTIMIZERS[name]
    betas_default = (c.adam_beta1, c.adam_beta2, c.adam_epsilon) == (0.9, 0.999, 1e-8)
    if ctx.optimizer_object:
        return  # the trainer passes the given optimizer (GRPOTrainer optimizers=)
    if name == "adamw_torch_fused" and betas_default and not extra:
        # TRL's default: the module's own AdamW (fused where the parameters' device has the kernel).
        b.set("model.learning_rate", c.learning_rate)
        b.set("model.weight_decay", c.weight_decay)
        return
    init_args: dict[str, Any] = {"lr": c.learning_rate, "weight_decay": c.weight_decay, **fixed}
    if adam_like:
        init_args.update(betas=[c.adam_beta1, c.adam_beta2], eps=c.adam_epsilon)
    b.set("model.optimizer", {"class_path": class_path, "init_args": {**init_args, **extra}})


def _optim_args(text: str | None) -> dict[str, Any]:
    """``"momentum=0.9,nesterov=True"`` as ``{"momentum": 0.9, "nesterov": True}``."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"GRPOConfig.optim_args={text!r}: write key=value pairs separated by commas.")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def schedule(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    name = getattr(c.lr_scheduler_type, "value", c.lr_scheduler_type)
    if name not in SCHEDULERS:
        raise ConfigError(f"GRPOConfig.lr_scheduler_type={name!r} is not supported: use one of {', '.join(SCHEDULERS)}.")
    if c.lr_scheduler_kwargs:
        raise ConfigError(f"GRPOConfig.lr_scheduler_kwargs={c.lr_scheduler_kwargs!r}: the schedules "
                          f"({', '.join(SCHEDULERS)}) take no extra arguments; remove it.")
    b.set("model.lr_scheduler_type", name)
    if 0 < c.warmup_steps < 1:
        b.set("model.warmup_ratio", float(c.warmup_steps))  # transformers 5: below 1 is a ratio
    else:
        b.set("model.warmup_steps", int(c.warmup_steps))


def precision(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    b.set("trainer.precision", "16-mixed" if c.fp16 else "bf16-mixed" if c.bf16 else "32-true")
    b.set("trainer.accumulate_grad_batches", c.gradient_accumulation_steps)
    b.set("trainer.gradient_clip_val", c.max_grad_norm if c.max_grad_norm and c.max_grad_norm > 0 else None)  # HF: <= 0 skips
    b.set("model.gradient_checkpointing", bool(c.gradient_checkpointing))
    if c.full_determinism:
        b.set("trainer.deterministic", True)
    if c.use_cpu:
        b.set("trainer.accelerator", "cpu")


def logging(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    if c.logging_strategy != "steps":
        raise ConfigError(f"GRPOConfig.logging_strategy={c.logging_strategy!r}: metrics are logged every "
                          "logging_steps optimizer steps only; use logging_strategy='steps' (report_to='none' "
                          "turns the trackers off).")
    b.set("trainer.log_every_n_steps", _steps(c, "logging_steps", c.logging_steps))
    b.set("trainer.enable_progress_bar", not c.disable_tqdm)
    reports = [c.report_to] if isinstance(c.report_to, str) or c.report_to is None else list(c.report_to)
    reports = [r for r in reports if r not in (None, "none")]
    unknown = [r for r in reports if r not in LOGGERS]
    if unknown:
        raise ConfigError(f"GRPOConfig.report_to={c.report_to!r}: {unknown} not supported; use {', '.join(LOGGERS)} "
                          "or 'none', or any Lightning logger in YAML (trainer.logger).")
    if not reports:
        b.set("trainer.logger", False)
    elif len(reports) == 1 and LOGGERS[reports[0]] is None:
        b.set("trainer.logger", None)  # the CLI's MLflow store in the run folder
        if c.run_name:
            b.ignore("run_name", c.run_name, "the default MLflow logger names its runs itself; set trainer.logger "
                     "in YAML to choose")
    else:
        if any(LOGGERS[r] is None for r in reports):
            raise ConfigError(f"GRPOConfig.report_to={c.report_to!r}: MLflow (the default logger) cannot be combined "
                              "with other trackers here; choose one, or list the loggers in YAML (trainer.logger).")
        b.set("trainer.logger", [_logger(LOGGERS[r], c) for r in reports])


def _logger(class_path: str, c: Any) -> dict[str, Any]:
    init: dict[str, Any] = {"save_dir": c.output_dir}
    if class_path.endswith("WandbLogger"):
        init.update(project=c.project, name=c.run_name)
    elif class_path.endswith("TensorBoardLogger") and c.run_name:
        init["name"] = c.run_name
    return {"class_path": class_path, "init_args": init}


def evaluation(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    """``eval_strategy``: never (validation off during fit), every ``eval_steps`` optimizer steps, or each epoch."""
    b.set("data.per_device_eval_batch_size", c.per_device_eval_batch_size)
    if c.eval_strategy != "no" and not ctx.has_eval_dataset:
        raise ConfigError(f"GRPOConfig.eval_strategy={c.eval_strategy!r} needs an eval_dataset: pass eval_dataset= "
                          "to GRPOTrainer, or set eval_strategy='no'.")
    if not ctx.has_eval_dataset:
        return
    if c.eval_strategy == "no":
        b.set("trainer.limit_val_batches", 0)  # evaluate() alone evaluates
    elif c.eval_strategy == "steps":
        # Lightning counts training batches (micro-steps): one optimizer step is accumulate_grad_batches of them.
        b.set("trainer.val_check_interval", _steps(c, "eval_steps", c.eval_steps) * c.gradient_accumulation_steps)
        b.set("trainer.check_val_every_n_epoch", None)
    else:
        b.set("trainer.check_val_every_n_epoch", 1)


def checkpoints(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    if c.load_best_model_at_end:
        raise ConfigError("GRPOConfig.load_best_model_at_end=True is not supported: keep the best checkpoint with a "
                          "ModelCheckpoint(monitor='eval_reward', mode='max') in YAML (trainer.callbacks).")
    if c.metric_for_best_model is not None:
        b.ignore("metric_for_best_model", c.metric_for_best_model, "used only with load_best_model_at_end")
    if c.save_strategy in ("epoch", "best"):
        raise ConfigError(f"GRPOConfig.save_strategy={c.save_strategy!r} is not supported: use 'steps' (save_steps) "
                          "or 'no'; a ModelCheckpoint in YAML (trainer.callbacks) can do the rest.")
    if c.save_strategy == "no":
        b.set("trainer.enable_checkpointing", False)
        return
    b.set("checkpoint_every_n_steps", _steps(c, "save_steps", c.save_steps))
    if c.save_total_limit is not None:
        if c.save_total_limit < 1:
            raise ConfigError(f"GRPOConfig.save_total_limit={c.save_total_limit}: keep at least 1 checkpoint, or None.")
        b.set("keep_checkpoints", c.save_total_limit)


def seeds(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    b.set("seed_everything", c.seed)
    if c.data_seed is not None:
        b.set("data.seed", c.data_seed)


def strategy(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    """DeepSpeed from ``deepspeed`` when its strategy is available; FSDP and the DDP knobs only in YAML."""
    if c.deepspeed is not None:
        if "deepspeed" not in ctx.strategies:
            raise ConfigError("GRPOConfig.deepspeed is set but no DeepSpeed strategy is available: set trainer.strategy "
                              "in YAML.")
        b.set("trainer.strategy", {"class_path": "grpo_lightning.module.deepspeed_strategy.GRPODeepSpeedStrategy",
                                   "init_args": {"config": c.deepspeed,
                                                 "ds3_gather_for_generation": c.ds3_gather_for_generation}})
    set_here = [name for name, default in _STRATEGY_DEFAULTS.items() if getattr(c, name) not in default]
    if set_here:
        raise ConfigError(f"GRPOConfig {', '.join(f'{n}={getattr(c, n)!r}' for n in set_here)}: set the strategy "
                          "(FSDP, DDP options, parallelism) in YAML (trainer.strategy: class_path + init_args) and run "
                          "grpo fit; see docs/trl_mapping.md.")


_STRATEGY_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "fsdp": (None, "", [], False), "fsdp_config": (None, {}), "parallelism_config": (None,),
    "ddp_find_unused_parameters": (None,), "ddp_bucket_cap_mb": (None,), "ddp_broadcast_buffers": (None,),
    "ddp_static_graph": (None,), "ddp_backend": (None,), "ddp_timeout": (1800,),
}  # fmt: skip

#: Converter -> the fields it reads (every field is read by one converter or is not applicable).
CONVERTERS: dict[Callable[[Any, ConfigBuilder, Context], None], tuple[str, ...]] = {
    run_length: ("output_dir", "per_device_train_batch_size", "num_train_epochs", "max_steps"),
    optimizer: ("optim", "optim_args", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                "optim_target_modules"),
    schedule: ("lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps"),
    precision: ("bf16", "fp16", "gradient_accumulation_steps", "max_grad_norm", "gradient_checkpointing",
                "full_determinism", "use_cpu"),
    logging: ("logging_strategy", "logging_steps", "disable_tqdm", "report_to", "run_name", "project"),
    evaluation: ("eval_strategy", "eval_steps", "per_device_eval_batch_size"),
    checkpoints: ("save_strategy", "save_steps", "save_total_limit", "load_best_model_at_end", "metric_for_best_model",
                  "greater_is_better"),
    seeds: ("seed", "data_seed"),
    strategy: ("deepspeed", "ds3_gather_for_generation", *_STRATEGY_DEFAULTS),
}

"""``GRPOTrainer``'s arguments -> the ``grpo fit`` config they amount to (one builder, used both by
the run and by the YAML export, so the two cannot differ).

Layer L7 (trl_compat).
"""

from __future__ import annotations

import inspect
from typing import Any

from grpo_lightning.errors import ConfigError
from grpo_lightning.trl_compat import inputs
from grpo_lightning.trl_compat.builder import ConfigBuilder, InMemory
from grpo_lightning.trl_compat.convert import convert_config
from grpo_lightning.trl_compat.convert_training import Context


class GivenOptimizer:
    """``model.optimizer`` for an optimizer built by the caller (``optimizers=(optimizer, None)``):
    returns it when asked for the policy's optimizer, after checking it holds exactly the policy's
    trainable parameters (the same tensors)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def __call__(self, params: Any) -> Any:
        wanted = {id(p) for p in params}
        given = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        if wanted != given:
            raise ConfigError(
                "optimizers=(optimizer, ...): the optimizer does not hold the trained model's parameters (it was built "
                "on other tensors, or the model was copied or cast when loaded). Build it on the parameters of the "
                "model object you pass as model=, or set args.optim / optim_args instead.")
        return self.optimizer


def available(*classes: Any) -> frozenset[str]:
    """``model.<arg>`` / ``data.<arg>`` for the ``__init__`` arguments of GRPOModule, RolloutDataModule."""
    keys = set()
    for section, cls in zip(("model", "data"), classes):
        keys |= {f"{section}.{name}" for name in inspect.signature(cls.__init__).parameters if name != "self"}
    return frozenset(keys)


def build_config(args: Any, *, model: Any = None, reward_funcs: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 optimizers: tuple[Any, Any] = (None, None), quantization_config: Any = None, peft_config: Any = None,
                 tools: Any = None, rollout_func: Any = None, environment_factory: Any = None,
                 require_data: bool = True) -> ConfigBuilder:
    """The ``grpo fit`` config of a ``GRPOTrainer`` (the ``fit`` section's content).

    In-memory datasets and tokenizers are written to ``<output_dir>/trl_inputs/`` now (``inputs.py``).
    """
    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule

    optimizer, scheduler = optimizers if optimizers is not None else (None, None)
    if scheduler is not None:
        raise ConfigError("optimizers=(optimizer, scheduler): a scheduler object is not supported; the schedule comes "
                          "from args.lr_scheduler_type and args.warmup_steps (model.lr_scheduler_type in YAML). Pass "
                          "optimizers=(optimizer, None).")
    if rollout_func is not None and (args.use_vllm or args.use_transformers_continuous_batching):
        raise ConfigError("rollout_func generates the completions itself: remove use_vllm / "
                          "use_transformers_continuous_batching, or rollout_func.")
    if train_dataset is None and environment_factory is None and require_data:
        raise ConfigError("GRPOTrainer needs train_dataset (only an environment_factory whose reset() returns the "
                          "prompt can train without one).")
    strategies = frozenset({"deepspeed"} if _has_deepspeed_strategy() else set())
    ctx = Context(has_eval_dataset=eval_dataset is not None, optimizer_object=optimizer is not None,
                  strategies=strategies, params=available(GRPOModule, RolloutDataModule))
    b = ConfigBuilder()
    inputs.agent_entries(b, tools, environment_factory)
    convert_config(args, b, ctx)
    inputs.rollout_entries(b, rollout_func)
    if model is not None:
        inputs.model_entries(b, args, model, processing_class, peft_config, quantization_config)
    inputs.reward_entries(b, args, reward_funcs, reward_processing_classes)
    inputs.dataset_entries(b, args, train_dataset, eval_dataset)
    if optimizer is not None:
        b.set("model.optimizer", InMemory(GivenOptimizer(optimizer), None, (
            "optimizers=(optimizer, None) is an optimizer object: give its class and settings instead (args.optim, "
            "args.optim_args; in YAML model.optimizer: {class_path: torch.optim.AdamW, init_args: {lr: ...}})")))
    # A run folder is written over as transformers' Trainer does (grpo fit asks first: --overwrite_run_dir).
    b.set("overwrite_run_dir", True)
    return b


def _has_deepspeed_strategy() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("grpo_lightning.module.deepspeed_strategy") is not None
    except ImportError:  # pragma: no cover
        return False

"""What ``GRPOModule`` does differently under DeepSpeed: when a step's metrics are published, where
its gradient norm comes from, and which combinations it refuses at setup.

Under DeepSpeed, Lightning calls ``on_before_optimizer_step`` on *every* micro-step (the engine,
not Lightning, decides which ``engine.step`` updates the weights), and ZeRO keeps the gradients in
its own partitioned buffers, not in ``param.grad``: the module's usual norm cannot be measured
there. The engine measures the global norm (before clipping, which it also does, with
``gradient_clipping = trainer.gradient_clip_val``) inside its step, so under DeepSpeed the module
publishes a step's metrics right after the engine's step, on the micro-step that ends the window.
The setup checks cover FSDP1 (Lightning's ``FSDPStrategy``) too.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from grpo_lightning.errors import ConfigError
from grpo_lightning.module.deepspeed_strategy import STRATEGY_PATH, GRPODeepSpeedStrategy


def deepspeed_engine(trainer: Any) -> Any:
    """The trainer's DeepSpeed engine once the strategy has built it, else None."""
    strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, DeepSpeedStrategy) and hasattr(strategy.model, "is_gradient_accumulation_boundary"):
        return strategy.model
    return None


def deepspeed_step_applied(trainer: Any) -> bool:
    """Whether the engine's step that just ran ended an accumulation window (False off DeepSpeed).
    ``GRPODeepSpeedStrategy`` sets the boundary before each micro-step, so it still reads true
    after the step."""
    engine = deepspeed_engine(trainer)
    return engine is not None and bool(engine.is_gradient_accumulation_boundary())


def deepspeed_grad_norm(trainer: Any) -> float:
    """The global gradient norm the engine measured in its last step (before clipping)."""
    norm = deepspeed_engine(trainer).get_global_grad_norm()
    return math.nan if norm is None else float(norm)


def check_strategy_setup(trainer: Any, *, adapters: bool) -> None:
    """Refuse what the module cannot train correctly under the trainer's DeepSpeed or FSDP1
    strategy (nothing to check under the others). ``adapters``: a PEFT/QLoRA policy."""
    strategy = trainer.strategy
    sampler = getattr(getattr(trainer, "datamodule", None), "sampler", None)
    if isinstance(strategy, FSDPStrategy) and getattr(sampler, "keeps_own_weights", False):
        raise ConfigError(
            f"data.sampler={type(sampler).__name__} with trainer.strategy=FSDPStrategy (FSDP1): pushing weights into "
            "vLLM is implemented for FSDP2 and DeepSpeed, not FSDP1. Use FSDP2 (trainer.strategy: "
            "{class_path: lightning.pytorch.strategies.ModelParallelStrategy}) or configs/strategy/deepspeed_zero3.yaml."
        )
    if not isinstance(strategy, DeepSpeedStrategy):
        return
    if not isinstance(strategy, GRPODeepSpeedStrategy):
        raise ConfigError(
            f"trainer.strategy={type(strategy).__name__} (Lightning's DeepSpeed strategy) divides the loss by "
            f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} a second time in its engine's backward "
            "and counts accumulation windows apart from Lightning. Use trainer.strategy: {class_path: "
            f"{STRATEGY_PATH}, init_args: {{stage: 3}}}} (its arguments are Lightning's; recipes in configs/strategy/, "
            "e.g. --config configs/strategy/deepspeed_zero3.yaml)."
        )
    if not strategy.zero_stage_3:
        return
    if adapters:
        raise ConfigError(
            "model.peft_config/quantization_config with DeepSpeed ZeRO-3 is not supported (merging the adapters for "
            "generation and export needs the whole base weights): use ZeRO-2 (configs/strategy/deepspeed_zero2.yaml), "
            "where the frozen base is not partitioned anyway, or DDP/FSDP2."
        )
    generates_sharded = not strategy.ds3_gather_for_generation and not getattr(sampler, "keeps_own_weights", False)
    if generates_sharded and trainer.world_size > 1 and type(sampler).__name__ != "HFGenerateSampler":
        raise ConfigError(
            f"ds3_gather_for_generation: false with data.sampler={type(sampler).__name__} on {trainer.world_size} "
            "processes: generating with sharded weights runs a collective in every layer's forward, and only the "
            "hf_generate sampler keeps the ranks' forwards in step (synced_gpus). Use data.sampler: hf_generate, "
            "or set trainer.strategy.init_args.ds3_gather_for_generation: true."
        )

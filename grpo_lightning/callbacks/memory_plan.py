"""``MemoryPlanner``: estimate and print the peak memory per device before the first step."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch

from grpo_lightning.module.lm_head_calibration import planned_chunk_tokens
from grpo_lightning.data.prompt_format import tokenize_prompt
from grpo_lightning.utils.memory_plan import MemoryPlan, MemorySettings, ModelShape, estimate_memory
from grpo_lightning.utils.memory_report import device_memory_bytes, format_plan, memory_warning

log = logging.getLogger(__name__)

_STRATEGIES = {"SingleDeviceStrategy": "single", "DDPStrategy": "ddp", "FSDPStrategy": "fsdp", "ModelParallelStrategy": "fsdp2"}


class MemoryPlanner(pl.Callback):
    """Before the first step, logs the estimated peak memory per device, line by line (weights,
    reference, gradients, optimizer states, activations, LM-head logits, KV cache or vLLM share),
    and a warning naming the settings to change when it exceeds the device (``docs/memory.md``).

    Args:
        prompt_length: Prompt tokens to plan for; ``None`` measures the longest of the first
            ``prompt_sample_rows`` training prompts.
        prompt_sample_rows: Prompts tokenized to find the prompt length.
        headroom: Fraction of the device's memory the estimate may use before the warning.

    Attributes:
        estimate: The :class:`~grpo_lightning.utils.memory_plan.MemoryPlan` (``None`` before fit).
        device_bytes: The device memory it was compared with.
    """

    def __init__(self, prompt_length: int | None = None, prompt_sample_rows: int = 256, headroom: float = 0.9) -> None:
        self.prompt_length = prompt_length
        self.prompt_sample_rows = prompt_sample_rows
        self.headroom = headroom
        self.estimate: MemoryPlan | None = None
        self.device_bytes: int | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here the models are built and the optimizer exists, but no step has run.
        self.device_bytes, device = device_memory_bytes(pl_module.device)
        shape, settings = plan_inputs(trainer, pl_module, self.prompt_length, self.prompt_sample_rows, self.device_bytes)
        self.estimate = estimate_memory(shape, settings)
        if not trainer.is_global_zero:
            return
        log.info(format_plan(self.estimate, self.device_bytes, device))
        warning = memory_warning(self.estimate, self.device_bytes, device, self.headroom)
        if warning:
            log.warning(warning)


def plan_inputs(
    trainer: pl.Trainer, pl_module: Any, prompt_length: int | None = None, sample_rows: int = 256,
    device_bytes: int | None = None,
) -> tuple[ModelShape, MemorySettings]:
    """The estimator's inputs read off a run (a ``GRPOModule`` and a ``RolloutDataModule``)."""
    policy = pl_module.policy
    config = getattr(policy, "config", None)
    if config is None:
        raise ValueError(f"MemoryPlanner needs a transformers model with a config; got {type(policy).__name__}.")
    shape = ModelShape.from_config(config)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in policy.parameters() if not p.requires_grad)
    if trainable + frozen < shape.num_parameters // 2:  # FSDP1 flat shards: local pieces only
        trainable, frozen = shape.num_parameters, 0
    first = next((p for p in policy.parameters() if p.is_floating_point()), None)
    dm = trainer.datamodule
    rows = int(dm.per_device_train_batch_size)
    builder = getattr(dm, "builder", None)
    generation_rows = builder.settings.plan.local_rows if builder is not None else rows
    sampler = getattr(dm, "sampler", None)
    sampler_kind, vllm = _sampler_kind(sampler)
    max_batch_rows = getattr(sampler, "max_batch_rows", None)
    if max_batch_rows:
        generation_rows = min(generation_rows, max_batch_rows)
    # A generation batch is built at its first micro-step and the module drops an applied step's
    # gradients at the end of its batch: training generations run without them when they start
    # windows, and validation's when its checks fall between windows.
    without_gradients = (builder is not None and builder.settings.generation_starts_window
                         and not _evaluates_inside_windows(trainer, dm, int(trainer.accumulate_grad_batches)))
    needs_old = builder is not None and (builder.settings.needs_old_logprobs or builder.settings.corrects_sampling)
    options = pl_module.forward_options
    settings = MemorySettings(
        trainable_parameters=trainable, frozen_parameters=frozen,
        param_bytes=first.element_size() if first is not None else 4,
        precision=str(trainer.precision), optimizer=_optimizer_kind(trainer.optimizers),
        optimizer_foreach=_foreach(trainer.optimizers), strategy=_strategy_kind(trainer.strategy),
        world_size=trainer.world_size, reference=pl_module.ref_policy is not None, rows=rows,
        prompt_length=prompt_length or _longest_prompt(dm, pl_module.tokenizer, sample_rows),
        completion_length=int(dm.generation.max_completion_length), generation_rows=generation_rows,
        logprob_rows=rows if (needs_old or pl_module.ref_policy is not None) else None,
        gradient_checkpointing=bool(pl_module.model_settings.gradient_checkpointing),
        chunked_lm_head=options.chunked_lm_head,
        lm_head_chunk_tokens=planned_chunk_tokens(options.lm_head_chunk_tokens, pl_module.device),
        padding_free=options.padding_free, train_token_budget=options.train_token_budget,
        logprob_token_budget=options.logprob_token_budget, entropy_grad=getattr(pl_module, "entropy_coef", 0) != 0,
        attention="eager" if getattr(config, "_attn_implementation", None) == "eager" else "fused",
        sampler=sampler_kind, generation_weight_casts=bool(getattr(sampler, "cache_weight_casts", False)),
        device_bytes=device_bytes, gradients_at_generation=not without_gradients, **vllm,
    )
    return shape, settings


def _evaluates_inside_windows(trainer: pl.Trainer, dm: Any, accumulate: int) -> bool:
    """Validation generates too: it runs between batches, inside a window unless the check
    interval is a whole number of windows (a fraction of an epoch cannot be told here)."""
    if accumulate == 1 or not getattr(dm, "eval_datasets", None):
        return False
    interval = trainer.val_check_interval
    return interval % accumulate != 0 if isinstance(interval, int) else float(interval) < 1.0


def _sampler_kind(sampler: Any) -> tuple[str, dict[str, Any]]:
    name = type(sampler).__name__
    if name == "VLLMColocateSampler":
        kv = getattr(sampler, "kv_cache_memory_gib", None)
        return "vllm_colocate", {
            "vllm_gpu_memory_utilization": float(sampler.gpu_memory_utilization),
            "vllm_kv_cache_bytes": int(kv * 1024**3) if kv is not None else None,
            "vllm_sleep_mode": bool(getattr(sampler, "enable_sleep_mode", False)) and torch.cuda.is_available(),
        }
    if name == "VLLMServerSampler" or sampler is None:
        return "external", {}
    return "hf", {}  # generate on the live policy (HF generate, fast_generate, continuous batching)


def _optimizer_kind(optimizers: list[torch.optim.Optimizer]) -> str:
    if not optimizers:
        return "none"
    opt = optimizers[0]
    name, module = type(opt).__name__.lower(), type(opt).__module__
    if "8bit" in name or (module.startswith("bitsandbytes") and "8bit" in str(opt.defaults.get("optim_bits", ""))):
        return "adamw_8bit"
    if "sgd" in name:
        return "sgd_momentum" if opt.defaults.get("momentum", 0) else "sgd"
    return "adamw"  # Adam, AdamW and look-alikes keep two states per parameter


def _foreach(optimizers: list[torch.optim.Optimizer]) -> bool:
    if not optimizers:
        return False
    defaults = optimizers[0].defaults
    if defaults.get("fused"):
        return False
    # foreach=None lets torch pick the multi-tensor path on CUDA.
    return bool(defaults.get("foreach")) or (defaults.get("foreach") is None and torch.cuda.is_available())


def _strategy_kind(strategy: Any) -> str:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    name = type(strategy).__name__
    if isinstance(strategy, DeepSpeedStrategy):  # also GRPODeepSpeedStrategy
        stage = (getattr(strategy, "config", None) or {}).get("zero_optimization", {}).get("stage", 2)
        return f"deepspeed_stage_{stage}"
    return _STRATEGIES.get(name, "ddp" if "DDP" in name else "single")


def _longest_prompt(dm: Any, tokenizer: Any, sample_rows: int) -> int:
    """The longest prompt among the first training rows, formatted as the datamodule does."""
    dataset = dm.train_dataset
    longest = 1
    for index in range(min(sample_rows, len(dataset))):
        prompt = dataset[index]["prompt"]
        if getattr(dm, "prompt_as_chat", False) and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        system = getattr(dm, "system_prompt", None)
        if system is not None and isinstance(prompt, list) and prompt[0].get("role") != "system":
            prompt = [{"role": "system", "content": system}, *prompt]
        longest = max(longest, len(tokenize_prompt(prompt, tokenizer, getattr(dm, "chat_template_kwargs", None))))
    return longest

"""The GRPO half of ``GRPOConfig`` as ``grpo fit`` settings: model, generation, sampler, loss,
rewards, the callbacks some fields turn on, and the agent loop.

Layer L7 (trl_compat): the standard library only.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from grpo_lightning.errors import ConfigError
from grpo_lightning.trl_compat.builder import ConfigBuilder
from grpo_lightning.trl_compat.convert_training import Context

LOSS_CLASSES = {
    "grpo": "GRPOLoss", "dr_grpo": "DrGRPOLoss", "dapo": "DAPOLoss", "bnpo": "BNPOLoss", "cispo": "CISPOLoss",
    "sapo": "SAPOLoss", "luspo": "LUSPOLoss", "vespo": "VESPOLoss",
}  # fmt: skip
#: Loss knobs: every loss takes the first group; the others only the loss of that name.
LOSS_KNOBS = ("epsilon", "epsilon_high", "delta", "beta", "importance_sampling_level", "use_bias_correction_kl",
              "off_policy_mask_threshold")
LOSS_ONLY = {
    "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
}
SAMPLER = "grpo_lightning.samplers"
DTYPES = ("float32", "bfloat16", "float16", "auto")


def _json(name: str, value: Any) -> Any:
    """A dict field that transformers also accepts as a JSON string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"GRPOConfig.{name}={value!r} is not valid JSON: {err}.") from None
    return value


def optional(b: ConfigBuilder, ctx: Context, key: str, value: Any, default: Any, name: str) -> None:
    """Set ``key`` unless ``value`` is TRL's default; refuse a value whose key this version lacks."""
    if value == default:
        return
    if key not in ctx.params:
        raise ConfigError(f"GRPOConfig.{name}={value!r} is not supported yet: {key} does not exist in this version "
                          "(docs/trl_mapping.md lists what is pending).")
    b.set(key, value)


def model(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    kwargs = dict(_json("model_init_kwargs", c.model_init_kwargs) or {})
    for key in ("dtype", "torch_dtype"):
        if key in kwargs:
            dtype = str(kwargs.pop(key)).removeprefix("torch.")
            if dtype not in DTYPES:
                raise ConfigError(f"GRPOConfig.model_init_kwargs[{key!r}]={dtype!r}: use one of {', '.join(DTYPES)}.")
            b.set("model.dtype", dtype)
    if kwargs:
        b.set("model.model_init_kwargs", kwargs)
        b.set("data.reward_model_init_kwargs", kwargs)  # TRL loads reward models given as ids with them too
    if c.trust_remote_code:
        b.set("model.trust_remote_code", True)
        b.set("data.reward_trust_remote_code", True)
    b.set("model.disable_dropout", c.disable_dropout)
    optional(b, ctx, "model.cast_lm_head_to_fp32", c.cast_lm_head_to_fp32, False, "cast_lm_head_to_fp32")
    optional(b, ctx, "model.router_aux_loss_coef", c.router_aux_loss_coef, None, "router_aux_loss_coef")
    optional(b, ctx, "model.use_liger_kernel", c.use_liger_kernel, False, "use_liger_kernel")
    optional(b, ctx, "model.liger_kernel_config", c.liger_kernel_config, None, "liger_kernel_config")
    b.set("model.entropy_coef", c.entropy_coef)
    optional(b, ctx, "model.top_entropy_quantile", c.top_entropy_quantile, 1.0, "top_entropy_quantile")


def generation(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    if c.max_completion_length is None:
        raise ConfigError("GRPOConfig.max_completion_length=None: give a number of tokens (completions need a limit).")
    b.set("data.generation", {
        "max_completion_length": c.max_completion_length, "temperature": c.temperature, "top_p": c.top_p,
        "top_k": c.top_k, "min_p": c.min_p, "repetition_penalty": c.repetition_penalty,
        "generation_kwargs": _json("generation_kwargs", c.generation_kwargs),
    })
    b.set("data.num_generations", c.num_generations)
    if c.num_generations_eval:  # TRL: None or 0 means num_generations
        b.set("data.num_generations_eval", c.num_generations_eval)
    b.set("data.shuffle_dataset", bool(c.shuffle_dataset))
    optional(b, ctx, "data.pad_to_multiple_of", c.pad_to_multiple_of, None, "pad_to_multiple_of")
    if c.steps_per_generation != c.gradient_accumulation_steps:  # generation_batch_size follows from it
        b.set("data.steps_per_generation", c.steps_per_generation)
    kwargs = _json("chat_template_kwargs", c.chat_template_kwargs)
    if kwargs:
        b.set("data.chat_template_kwargs", kwargs)


def sampler(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    """vLLM (colocate or server), transformers' continuous batching, or plain ``generate``."""
    if c.use_vllm:
        common = {"structured_outputs_regex": c.vllm_structured_outputs_regex}
        if c.vllm_mode == "colocate":
            init = {"gpu_memory_utilization": c.vllm_gpu_memory_utilization, "max_model_length": c.vllm_max_model_length,
                    "tensor_parallel_size": c.vllm_tensor_parallel_size, "model_impl": c.vllm_model_impl,
                    "enable_sleep_mode": c.vllm_enable_sleep_mode, **common}
            spec = {"class_path": f"{SAMPLER}.vllm_colocate.VLLMColocateSampler", "init_args": init}
        else:
            init = {"base_url": c.vllm_server_base_url, "host": c.vllm_server_host, "port": c.vllm_server_port,
                    "server_timeout": c.vllm_server_timeout, "group_port": c.vllm_group_port, **common}
            spec = {"class_path": f"{SAMPLER}.vllm_server.VLLMServerSampler", "init_args": init}
    elif c.use_transformers_continuous_batching:
        config = _json("transformers_continuous_batching_config", c.transformers_continuous_batching_config)
        spec = {"class_path": f"{SAMPLER}.continuous_batching.ContinuousBatchingSampler",
                "init_args": {"continuous_batching_config": config}}
    else:
        spec = {"class_path": f"{SAMPLER}.hf_generate.HFGenerateSampler",
                "init_args": {"cache_implementation": c.cache_implementation}}
    b.set("data.sampler", spec)
    b.set("data.importance_sampling", {
        "enabled": c.vllm_importance_sampling_correction, "mode": c.vllm_importance_sampling_mode,
        "clip_min": c.vllm_importance_sampling_clip_min, "clip_max": c.vllm_importance_sampling_clip_max,
    })


def loss(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    name = c.loss_type
    if name not in LOSS_CLASSES:
        raise ConfigError(f"GRPOConfig.loss_type={name!r}: use one of {', '.join(LOSS_CLASSES)}.")
    init = {k: getattr(c, k) for k in (*LOSS_KNOBS, *LOSS_ONLY.get(name, ()))}
    for other, knobs in LOSS_ONLY.items():
        if other != name:
            for knob in knobs:
                default = _DEFAULTS[knob]
                if getattr(c, knob) != default:
                    b.ignore(knob, getattr(c, knob), f"read by loss_type={other!r} only (TRL ignores it too)")
    b.set("model.loss", {"class_path": f"grpo_lightning.losses.{LOSS_CLASSES[name]}", "init_args": init})


_DEFAULTS = {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0,
             "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}


def rewards(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    b.set("data.num_iterations", c.num_iterations)
    if c.reward_weights is not None:
        b.set("data.reward_weights", list(c.reward_weights))
    b.set("data.scale_rewards", c.scale_rewards)
    b.set("data.multi_objective_aggregation", c.multi_objective_aggregation)
    b.set("data.mask_truncated_completions", c.mask_truncated_completions)


def callbacks(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    """The fields that turn on a callback: RefModelSync, AdaptiveEntropy, CompletionLogger."""
    if c.sync_ref_model:
        b.append("trainer.callbacks", {"class_path": "grpo_lightning.callbacks.RefModelSync", "init_args": {
            "ref_model_mixup_alpha": c.ref_model_mixup_alpha, "ref_model_sync_steps": c.ref_model_sync_steps}})
    if c.use_adaptive_entropy:
        b.append("trainer.callbacks", {"class_path": "grpo_lightning.callbacks.AdaptiveEntropy", "init_args": {
            "entropy_target": c.entropy_target, "entropy_coef_delta": c.entropy_coef_delta,
            "entropy_coef_min": c.entropy_coef_min, "entropy_coef_max": c.entropy_coef_max}})
    if c.log_completions:
        b.append("trainer.callbacks", {"class_path": "grpo_lightning.callbacks.CompletionLogger", "init_args": {
            "num_completions_to_print": c.num_completions_to_print, "log_unique_prompts": c.log_unique_prompts,
            "log_completions_hub_repo": c.log_completions_hub_repo, "hub_private_repo": c.hub_private_repo,
            "log_multimodal": c.log_multimodal}})


def agent(c: Any, b: ConfigBuilder, ctx: Context) -> None:
    """``max_tool_calling_iterations`` joins ``tools`` / ``environment_factory`` (set by the trainer)."""
    if b.get("data.agent") is not None:
        b.set("data.agent.max_tool_calling_iterations", c.max_tool_calling_iterations)
    elif c.max_tool_calling_iterations is not None:
        b.ignore("max_tool_calling_iterations", c.max_tool_calling_iterations, "no tools or environment_factory given")


#: Converter -> the fields it reads (``agent`` runs after the trainer has set ``data.agent``).
CONVERTERS: dict[Callable[[Any, ConfigBuilder, Context], None], tuple[str, ...]] = {
    model: ("model_init_kwargs", "trust_remote_code", "disable_dropout", "cast_lm_head_to_fp32", "router_aux_loss_coef",
            "use_liger_kernel", "liger_kernel_config", "entropy_coef", "top_entropy_quantile"),
    generation: ("max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "generation_kwargs", "num_generations", "num_generations_eval", "shuffle_dataset",
                 "pad_to_multiple_of", "steps_per_generation", "generation_batch_size", "chat_template_kwargs"),
    sampler: ("use_vllm", "vllm_mode", "vllm_structured_outputs_regex", "vllm_gpu_memory_utilization",
              "vllm_max_model_length", "vllm_tensor_parallel_size", "vllm_model_impl", "vllm_enable_sleep_mode",
              "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
              "use_transformers_continuous_batching", "transformers_continuous_batching_config", "cache_implementation",
              "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
              "vllm_importance_sampling_clip_max", "use_transformers_paged", "vllm_importance_sampling_cap"),
    loss: ("loss_type", *LOSS_KNOBS, *LOSS_ONLY["sapo"], *LOSS_ONLY["vespo"]),
    rewards: ("num_iterations", "reward_weights", "scale_rewards", "multi_objective_aggregation",
              "mask_truncated_completions"),
    callbacks: ("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "use_adaptive_entropy",
                "entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max", "log_completions",
                "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo", "hub_private_repo",
                "log_multimodal"),
    agent: ("max_tool_calling_iterations",),
}

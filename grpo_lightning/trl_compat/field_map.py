"""Where each ``GRPOConfig`` field goes in a ``grpo fit`` config (machine-readable docs/trl_mapping.md).

A value is either the dotted YAML key that takes the field (``model.learning_rate`` is
``model: {learning_rate: ...}``; ``trainer.callbacks[AdaptiveEntropy]`` is an entry of
``trainer.callbacks`` with that class; a key without a section is a top-level ``grpo fit`` option),
or ``"not applicable: <reason>"``. Several fields may share a key (``bf16`` and ``fp16`` are both
``trainer.precision``).

Layer L7 (trl_compat): the standard library only.
"""

from __future__ import annotations

NOT_APPLICABLE = "not applicable: "
#: A key this version does not have yet: ``"pending: <key> (<why>)"``; setting the field is refused.
PENDING = "pending: "
_AE, _RS, _CL = "trainer.callbacks[AdaptiveEntropy]", "trainer.callbacks[RefModelSync]", "trainer.callbacks[CompletionLogger]"
_OPT = "model.optimizer"  # a class_path with its init_args (any torch optimizer)
_VC, _VS = "data.sampler[VLLMColocateSampler]", "data.sampler[VLLMServerSampler]"
_NO_EVAL_STORE = NOT_APPLICABLE + "evaluation computes GRPO's rewards and metrics, not a compute_metrics over stored predictions"
_HUB = NOT_APPLICABLE + ("read by GRPOTrainer.save_model / push_to_hub (Python); grpo fit saves the final model to "
                          "<run folder>/final_model, upload it with huggingface-cli")
_LOADER = NOT_APPLICABLE + "rollouts are built in the training process right before use (no DataLoader workers)"
_DDP = "trainer.strategy"  # DDPStrategy(init_args: find_unused_parameters, static_graph, timeout, ...)
_SCRIPT = NOT_APPLICABLE + "a script flag of HF's example scripts; grpo fit / grpo validate choose what runs"
_TRACKIO = NOT_APPLICABLE + "trackio is not a Lightning logger; use trainer.logger"

FIELD_TO_YAML: dict[str, str] = {
    # TrainingArguments fields
    "output_dir": "trainer.default_root_dir",
    "per_device_train_batch_size": "data.per_device_train_batch_size",
    "num_train_epochs": "trainer.max_epochs",
    "max_steps": "trainer.max_steps",
    "learning_rate": "model.learning_rate",
    "lr_scheduler_type": "model.lr_scheduler_type",
    "lr_scheduler_kwargs": NOT_APPLICABLE + "the schedules of model.lr_scheduler_type take no extra arguments",
    "warmup_steps": "model.warmup_steps",
    "optim": _OPT,
    "optim_args": _OPT,
    "weight_decay": "model.weight_decay",
    "adam_beta1": _OPT,
    "adam_beta2": _OPT,
    "adam_epsilon": _OPT,
    "optim_target_modules": _OPT,
    "gradient_accumulation_steps": "trainer.accumulate_grad_batches",
    "average_tokens_across_devices": NOT_APPLICABLE + "token-normalised losses always count the tokens of all ranks",
    "max_grad_norm": "trainer.gradient_clip_val",
    "label_smoothing_factor": NOT_APPLICABLE + "GRPO's loss has no labels to smooth",
    "bf16": "trainer.precision",
    "fp16": "trainer.precision",
    "bf16_full_eval": NOT_APPLICABLE + "evaluation runs at trainer.precision",
    "fp16_full_eval": NOT_APPLICABLE + "evaluation runs at trainer.precision",
    "tf32": NOT_APPLICABLE + "call torch.set_float32_matmul_precision('high') (Lightning suggests it on Ampere GPUs)",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "gradient_checkpointing_kwargs": NOT_APPLICABLE + "non-reentrant checkpointing is always used",
    "torch_compile": NOT_APPLICABLE + "the training forward is not compiled",
    "torch_compile_backend": NOT_APPLICABLE + "the training forward is not compiled",
    "torch_compile_mode": NOT_APPLICABLE + "the training forward is not compiled",
    "use_liger_kernel": PENDING + "model.use_liger_kernel (Liger kernels are not wired in yet)",
    "liger_kernel_config": PENDING + "model.use_liger_kernel (Liger kernels are not wired in yet)",
    "use_cache": NOT_APPLICABLE + "the cache is off in training forwards and on during generation",
    "neftune_noise_alpha": NOT_APPLICABLE + "NEFTune is a supervised fine-tuning technique, not used by GRPO",
    "torch_empty_cache_steps": NOT_APPLICABLE + "the device cache is not emptied periodically",
    "auto_find_batch_size": NOT_APPLICABLE + "refused by GRPO (groups would be split)",
    "logging_strategy": "trainer.log_every_n_steps",
    "logging_steps": "trainer.log_every_n_steps",
    "logging_first_step": "trainer.callbacks",  # TRLStepFlow(log_first_step=...)
    "log_on_each_node": NOT_APPLICABLE + "loggers write from global rank 0",
    "logging_nan_inf_filter": NOT_APPLICABLE + "logged values are exact means (NaN stays visible)",
    "include_num_input_tokens_seen": NOT_APPLICABLE + "num_tokens (prompt + completion tokens) is always logged",
    "log_level": NOT_APPLICABLE + "use Python logging for the grpo_lightning logger",
    "log_level_replica": NOT_APPLICABLE + "use Python logging for the grpo_lightning logger",
    "disable_tqdm": "trainer.enable_progress_bar",
    "report_to": "trainer.logger",
    "run_name": "trainer.logger",
    "project": "trainer.logger",
    "trackio_space_id": _TRACKIO,
    "trackio_bucket_id": _TRACKIO,
    "trackio_static_space_id": _TRACKIO,
    "eval_strategy": "trainer.val_check_interval",
    "eval_steps": "trainer.val_check_interval",
    "eval_delay": NOT_APPLICABLE + "evaluation starts at the first trainer.val_check_interval",
    "per_device_eval_batch_size": "data.per_device_eval_batch_size",
    "prediction_loss_only": _NO_EVAL_STORE,
    "eval_on_start": NOT_APPLICABLE + "Lightning's sanity check (trainer.num_sanity_val_steps) runs but logs no metrics",
    "eval_do_concat_batches": _NO_EVAL_STORE,
    "eval_use_gather_object": _NO_EVAL_STORE,
    "eval_accumulation_steps": _NO_EVAL_STORE,
    "include_for_metrics": _NO_EVAL_STORE,
    "batch_eval_metrics": _NO_EVAL_STORE,
    "save_only_model": NOT_APPLICABLE + "checkpoints are always complete (exact resume)",
    "save_strategy": "checkpoint_every_n_steps",
    "save_steps": "checkpoint_every_n_steps",
    "save_on_each_node": NOT_APPLICABLE + "Lightning writes checkpoints from rank 0 (sharded strategies: every rank its shard)",
    "save_total_limit": "keep_checkpoints",
    "enable_jit_checkpoint": NOT_APPLICABLE + "a checkpoint is written when training fails; SIGTERM handling is Lightning's",
    "push_to_hub": _HUB,
    "hub_token": _HUB,
    "hub_private_repo": _CL,
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "hub_always_push": _HUB,
    "hub_revision": _HUB,
    "load_best_model_at_end": "trainer.callbacks[ModelCheckpoint]",
    "metric_for_best_model": "trainer.callbacks[ModelCheckpoint]",
    "greater_is_better": "trainer.callbacks[ModelCheckpoint]",
    "ignore_data_skip": NOT_APPLICABLE + "a resumed run always continues at its saved prompt position",
    "restore_callback_states_from_checkpoint": NOT_APPLICABLE + "callback states are always restored on resume",
    "full_determinism": "trainer.deterministic",
    "seed": "seed_everything",
    "data_seed": "data.seed",
    "use_cpu": "trainer.accelerator",
    "accelerator_config": NOT_APPLICABLE + "there is no accelerate Accelerator; trainer.strategy and trainer.plugins configure devices",
    "parallelism_config": "trainer.strategy",
    "dataloader_drop_last": _LOADER,
    "dataloader_num_workers": _LOADER,
    "dataloader_pin_memory": _LOADER,
    "dataloader_persistent_workers": _LOADER,
    "dataloader_prefetch_factor": _LOADER,
    "dataloader_multiprocessing_context": _LOADER,
    "dataloader_in_order": _LOADER,
    "remove_unused_columns": NOT_APPLICABLE + "every dataset column reaches the reward functions",
    "label_names": NOT_APPLICABLE + "GRPO batches have no labels",
    "train_sampling_strategy": NOT_APPLICABLE + "TRL's GRPO sampler ignores it: shuffle_dataset decides the order",
    "length_column_name": NOT_APPLICABLE + "no group_by_length sampling",
    "ddp_find_unused_parameters": _DDP,
    "ddp_bucket_cap_mb": _DDP,
    "ddp_broadcast_buffers": _DDP,
    "ddp_static_graph": _DDP,
    "ddp_backend": _DDP,
    "ddp_timeout": _DDP,
    "fsdp": "trainer.strategy",
    "fsdp_config": "trainer.strategy",
    "deepspeed": "trainer.strategy",
    "debug": NOT_APPLICABLE + "HF Trainer debug options (underflow detection, TPU metrics) have no counterpart",
    "skip_memory_metrics": NOT_APPLICABLE + "HF's memory-profiling metrics; grpo fit prints a memory plan instead (memory_plan)",
    "do_train": _SCRIPT,
    "do_eval": _SCRIPT,
    "do_predict": _SCRIPT,
    "resume_from_checkpoint": NOT_APPLICABLE + ("a script flag the HF Trainer does not read: pass "
                                                "GRPOTrainer.train(resume_from_checkpoint=...); grpo fit: --ckpt_path"),
    "local_rank": NOT_APPLICABLE + "set by the launcher (torchrun, SLURM), read by Lightning",
    # GRPO fields
    "model_init_kwargs": "model.model_init_kwargs",
    "trust_remote_code": "model.trust_remote_code",
    "router_aux_loss_coef": "model.router_aux_loss_coef",
    "disable_dropout": "model.disable_dropout",
    "cast_lm_head_to_fp32": "model.cast_lm_head_to_fp32",
    "num_generations": "data.num_generations",
    "num_generations_eval": "data.num_generations_eval",
    "max_completion_length": "data.generation.max_completion_length",
    "ds3_gather_for_generation": "trainer.strategy",
    "shuffle_dataset": "data.shuffle_dataset",
    "pad_to_multiple_of": PENDING + "data.pad_to_multiple_of (padding-free batches need none; not wired in yet)",
    "generation_batch_size": "data.generation_batch_size",
    "steps_per_generation": "data.steps_per_generation",
    "temperature": "data.generation.temperature",
    "top_p": "data.generation.top_p",
    "top_k": "data.generation.top_k",
    "min_p": "data.generation.min_p",
    "generation_kwargs": "data.generation.generation_kwargs",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "repetition_penalty": "data.generation.repetition_penalty",
    "cache_implementation": "data.sampler[HFGenerateSampler].init_args.cache_implementation",
    "use_vllm": "data.sampler",
    "vllm_mode": "data.sampler",
    "vllm_model_impl": f"{_VC}.init_args.model_impl",
    "vllm_enable_sleep_mode": f"{_VC}.init_args.enable_sleep_mode",
    "vllm_structured_outputs_regex": "data.sampler.init_args.structured_outputs_regex",
    "vllm_server_base_url": f"{_VS}.init_args.base_url",
    "vllm_server_host": f"{_VS}.init_args.host",
    "vllm_server_port": f"{_VS}.init_args.port",
    "vllm_server_timeout": f"{_VS}.init_args.server_timeout",
    "vllm_group_port": f"{_VS}.init_args.group_port",
    "vllm_gpu_memory_utilization": f"{_VC}.init_args.gpu_memory_utilization",
    "vllm_max_model_length": f"{_VC}.init_args.max_model_length",
    "vllm_tensor_parallel_size": f"{_VC}.init_args.tensor_parallel_size",
    "beta": "model.loss.init_args.beta",
    "num_iterations": "data.num_iterations",
    "epsilon": "model.loss.init_args.epsilon",
    "delta": "model.loss.init_args.delta",
    "epsilon_high": "model.loss.init_args.epsilon_high",
    "sapo_temperature_neg": "model.loss.init_args.sapo_temperature_neg",
    "sapo_temperature_pos": "model.loss.init_args.sapo_temperature_pos",
    "vespo_k_pos": "model.loss.init_args.vespo_k_pos",
    "vespo_lambda_pos": "model.loss.init_args.vespo_lambda_pos",
    "vespo_k_neg": "model.loss.init_args.vespo_k_neg",
    "vespo_lambda_neg": "model.loss.init_args.vespo_lambda_neg",
    "importance_sampling_level": "model.loss.init_args.importance_sampling_level",
    "reward_weights": "data.reward_weights",
    "multi_objective_aggregation": "data.multi_objective_aggregation",
    "scale_rewards": "data.scale_rewards",
    "loss_type": "model.loss",
    "mask_truncated_completions": "data.mask_truncated_completions",
    "sync_ref_model": _RS,
    "ref_model_mixup_alpha": f"{_RS}.init_args.ref_model_mixup_alpha",
    "ref_model_sync_steps": f"{_RS}.init_args.ref_model_sync_steps",
    "top_entropy_quantile": "model.top_entropy_quantile",
    "entropy_coef": "model.entropy_coef",
    "use_adaptive_entropy": _AE,
    "entropy_coef_min": f"{_AE}.init_args.entropy_coef_min",
    "entropy_coef_max": f"{_AE}.init_args.entropy_coef_max",
    "entropy_coef_delta": f"{_AE}.init_args.entropy_coef_delta",
    "entropy_target": f"{_AE}.init_args.entropy_target",
    "max_tool_calling_iterations": "data.agent.max_tool_calling_iterations",
    "vllm_importance_sampling_correction": "data.importance_sampling.enabled",
    "vllm_importance_sampling_mode": "data.importance_sampling.mode",
    "vllm_importance_sampling_clip_max": "data.importance_sampling.clip_max",
    "vllm_importance_sampling_clip_min": "data.importance_sampling.clip_min",
    "off_policy_mask_threshold": "model.loss.init_args.off_policy_mask_threshold",
    "use_bias_correction_kl": "model.loss.init_args.use_bias_correction_kl",
    "log_completions": _CL,
    "log_multimodal": f"{_CL}.init_args.log_multimodal",
    "num_completions_to_print": f"{_CL}.init_args.num_completions_to_print",
    "log_unique_prompts": f"{_CL}.init_args.log_unique_prompts",
    "log_completions_hub_repo": f"{_CL}.init_args.log_completions_hub_repo",
    "use_transformers_continuous_batching": "data.sampler",
    "transformers_continuous_batching_config": "data.sampler[ContinuousBatchingSampler].init_args.continuous_batching_config",
    "use_transformers_paged": "data.sampler",
    "vllm_importance_sampling_cap": "data.importance_sampling.clip_max",
}


def yaml_key(field: str) -> str | None:
    """The YAML key of a ``GRPOConfig`` field, or ``None`` when the field does not apply (or its
    key is still pending).

    >>> yaml_key("num_generations"), yaml_key("label_smoothing_factor")
    ('data.num_generations', None)
    """
    home = FIELD_TO_YAML[field]
    return None if home.startswith((NOT_APPLICABLE, PENDING)) else home


def pending_key(field: str) -> str | None:
    """The key a field will have once its feature lands (``None`` unless pending).

    >>> pending_key("use_liger_kernel")
    'model.use_liger_kernel'
    """
    home = FIELD_TO_YAML[field]
    return home.removeprefix(PENDING).split(" ")[0] if home.startswith(PENDING) else None


def not_applicable_reason(field: str) -> str | None:
    """Why a field has no YAML key, or ``None`` when it has one."""
    home = FIELD_TO_YAML[field]
    return home.removeprefix(NOT_APPLICABLE) if home.startswith(NOT_APPLICABLE) else None

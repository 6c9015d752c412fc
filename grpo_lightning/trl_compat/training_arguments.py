"""The ``transformers.TrainingArguments`` fields that the seed's ``GRPOConfig`` lists, in its order
and with its defaults (TRL's overrides applied: ``learning_rate`` 1e-6, ``logging_steps`` 10,
``gradient_checkpointing`` on, ``bf16`` unset = on unless ``fp16``, ``remove_unused_columns`` off).

Where each field goes in a ``grpo fit`` config: :data:`grpo_lightning.trl_compat.field_map.FIELD_TO_YAML`.

Layer L7 (trl_compat): the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from grpo_lightning.trl_compat.fields import option


@dataclass
class TrainingArgumentsFields:
    """The ``TrainingArguments`` half of :class:`~grpo_lightning.trl_compat.GRPOConfig`."""

    # Run length, optimizer, schedule
    output_dir: str | None = option(None, "Folder of checkpoints and the final model (unset: trainer_output).")
    per_device_train_batch_size: int = option(8, "Completions per device in one training micro-batch.")
    num_train_epochs: float = option(3.0, "Epochs over the prompts (used when max_steps is -1).")
    max_steps: int = option(-1, "Optimizer steps to take; -1: run num_train_epochs epochs.")
    learning_rate: float = option(1e-6, "Peak learning rate of the optimizer.")
    lr_scheduler_type: str = option("linear", "Learning-rate schedule (linear, cosine, constant, ...).")
    lr_scheduler_kwargs: dict | str | None = option(None, "Extra arguments of the schedule (dict or JSON string).")
    warmup_steps: float = option(0, "Warm-up optimizer steps; a value below 1 is a fraction of all steps.")
    optim: str = option("adamw_torch_fused", "Optimizer name (transformers' OptimizerNames).")
    optim_args: str | None = option(None, "Extra optimizer arguments as 'key=value,key=value'.")
    weight_decay: float = option(0.0, "Weight decay of the optimizer.")
    adam_beta1: float = option(0.9, "Adam beta1.")
    adam_beta2: float = option(0.999, "Adam beta2.")
    adam_epsilon: float = option(1e-8, "Adam epsilon.")
    optim_target_modules: None | str | list[str] = option(None, "Modules that optimizers such as GaLore update.")
    gradient_accumulation_steps: int = option(1, "Micro-batches accumulated per optimizer step.")
    average_tokens_across_devices: bool = option(True, "Normalise token counts over all devices.")
    max_grad_norm: float = option(1.0, "Gradient clipping norm (0 disables clipping).")
    label_smoothing_factor: float = option(0.0, "Label smoothing (not used by GRPO's loss).")

    # Precision, memory, kernels
    bf16: bool | None = option(None, "bf16 mixed precision; unset: on unless fp16 is set.")
    fp16: bool = option(False, "fp16 mixed precision.")
    bf16_full_eval: bool = option(False, "Evaluate in bf16 entirely.")
    fp16_full_eval: bool = option(False, "Evaluate in fp16 entirely.")
    tf32: bool | None = option(None, "Allow TF32 matmuls on Ampere or newer GPUs.")
    gradient_checkpointing: bool = option(True, "Recompute activations in backward to save memory.")
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = option(None, "Arguments of gradient_checkpointing_enable.")
    torch_compile: bool = option(False, "Compile the model with torch.compile.")
    torch_compile_backend: str | None = option(None, "torch.compile backend (setting it turns torch_compile on).")
    torch_compile_mode: str | None = option(None, "torch.compile mode (setting it turns torch_compile on).")
    use_liger_kernel: bool = option(False, "Patch the model with Liger kernels.")
    liger_kernel_config: dict[str, bool] | None = option(None, "Which Liger kernels to apply.")
    use_cache: bool = option(False, "Keep the model's KV cache on during training forwards.")
    neftune_noise_alpha: float | None = option(None, "NEFTune embedding-noise scale (not used by GRPO).")
    torch_empty_cache_steps: int | None = option(None, "Empty the device cache every this many steps (a positive int).")
    auto_find_batch_size: bool = option(False, "Halve the batch on out-of-memory: refused by GRPO (groups would split).")

    # Logging
    logging_strategy: str = option("steps", "When to log: no, steps or epoch.")
    logging_steps: float = option(10, "Log every this many optimizer steps; below 1: a fraction of all steps.")
    logging_first_step: bool = option(False, "Also log the first optimizer step.")
    log_on_each_node: bool = option(True, "Log on the main process of every node, not only the first.")
    logging_nan_inf_filter: bool = option(True, "Leave NaN/inf losses out of the logged mean.")
    include_num_input_tokens_seen: str | bool = option("no", "Count input tokens seen: no, all, non_padding (true: all).")
    log_level: str = option("passive", "Log level of the main process.")
    log_level_replica: str = option("warning", "Log level of the other processes.")
    disable_tqdm: bool | None = option(None, "Hide progress bars.")
    report_to: None | str | list[str] = option("none", "Experiment trackers to log to (none, all, mlflow, wandb, ...).")
    run_name: str | None = option(None, "Name of the run in the trackers.")
    project: str = option("huggingface", "Project name in the trackers (trackio).")
    trackio_space_id: str | None = option(None, "Hugging Face Space of the trackio dashboard.")
    trackio_bucket_id: str | None = option(None, "Bucket that stores the trackio data.")
    trackio_static_space_id: str | None | Literal[False] = option(None, "Static trackio Space (false: none).")

    # Evaluation
    eval_strategy: str = option("no", "When to evaluate: no, steps or epoch.")
    eval_steps: float | None = option(None, "Evaluate every this many steps (unset: logging_steps).")
    eval_delay: float = option(0, "Steps or epochs to wait before the first evaluation.")
    per_device_eval_batch_size: int = option(8, "Completions per device in one evaluation batch.")
    prediction_loss_only: bool = option(False, "Return only the loss from prediction steps.")
    eval_on_start: bool = option(False, "Evaluate once before training.")
    eval_do_concat_batches: bool = option(True, "Concatenate evaluation batches before computing metrics.")
    eval_use_gather_object: bool = option(False, "Gather nested evaluation outputs with gather_object.")
    eval_accumulation_steps: int | None = option(None, "Prediction steps accumulated before moving outputs to CPU.")
    include_for_metrics: list[str] = option(help="Extra inputs passed to compute_metrics.", factory=list)
    batch_eval_metrics: bool = option(False, "Compute metrics batch by batch.")

    # Checkpoints and the Hub
    save_only_model: bool = option(False, "Checkpoint the model only (no optimizer, scheduler, RNG).")
    save_strategy: str = option("steps", "When to checkpoint: no, steps, epoch or best.")
    save_steps: float = option(500, "Checkpoint every this many steps; below 1: a fraction of all steps.")
    save_on_each_node: bool = option(False, "Write checkpoints on every node.")
    save_total_limit: int | None = option(None, "Checkpoints kept (oldest deleted).")
    enable_jit_checkpoint: bool = option(False, "Checkpoint when the job receives a termination signal.")
    push_to_hub: bool = option(False, "Upload the model to the Hugging Face Hub.")
    hub_token: str | None = option(None, "Hub access token.")
    hub_private_repo: bool | None = option(None, "Create the Hub repository as private.")
    hub_model_id: str | None = option(None, "Hub repository to push to.")
    hub_strategy: str = option("every_save", "What to push and when: end, every_save, checkpoint, all_checkpoints.")
    hub_always_push: bool = option(False, "Push even while a previous push is running.")
    hub_revision: str | None = option(None, "Hub branch to push to.")
    load_best_model_at_end: bool = option(False, "Load the best checkpoint (metric_for_best_model) at the end.")
    metric_for_best_model: str | None = option(None, "Metric that decides the best checkpoint.")
    greater_is_better: bool | None = option(None, "Higher metric_for_best_model is better (unset: unless it ends in loss).")
    ignore_data_skip: bool = option(False, "On resume, do not skip the batches already seen.")
    restore_callback_states_from_checkpoint: bool = option(False, "Restore callback states on resume.")

    # Seeds, devices, data loading
    full_determinism: bool = option(False, "Deterministic algorithms everywhere (slower).")
    seed: int = option(42, "Global random seed.")
    data_seed: int | None = option(None, "Seed of the data order (unset: seed).")
    use_cpu: bool = option(False, "Train on the CPU even when a GPU is present.")
    accelerator_config: dict | str | None = option(None, "accelerate Accelerator settings (dict or JSON file).")
    parallelism_config: Any | None = option(None, "accelerate ParallelismConfig; context/sequence parallelism is refused.")
    dataloader_drop_last: bool = option(False, "Drop the last incomplete batch.")
    dataloader_num_workers: int = option(0, "Data-loading worker processes.")
    dataloader_pin_memory: bool = option(True, "Pin host memory of batches.")
    dataloader_persistent_workers: bool = option(False, "Keep data-loading workers between epochs.")
    dataloader_prefetch_factor: int | None = option(None, "Batches each worker loads ahead (needs workers).")
    dataloader_multiprocessing_context: str | None = option(None, "Start method of the data-loading workers.")
    dataloader_in_order: bool = option(True, "Yield batches in order when several workers load them.")
    remove_unused_columns: bool | None = option(False, "Keep only the prompt column (off: reward functions see all).")
    label_names: list[str] | None = option(None, "Input keys holding labels.")
    train_sampling_strategy: str = option("random", "Order of training samples: random, sequential, group_by_length.")
    length_column_name: str = option("length", "Column of precomputed lengths for group_by_length.")

    # Distributed
    ddp_find_unused_parameters: bool | None = option(None, "DDP's find_unused_parameters.")
    ddp_bucket_cap_mb: int | None = option(None, "DDP's bucket_cap_mb.")
    ddp_broadcast_buffers: bool | None = option(None, "DDP's broadcast_buffers.")
    ddp_static_graph: bool | None = option(None, "DDP's static_graph.")
    ddp_backend: str | None = option(None, "Process-group backend (nccl, gloo, ...).")
    ddp_timeout: int = option(1800, "Process-group timeout in seconds.")
    fsdp: str | None = option(None, "FSDP options (full_shard, auto_wrap, ...).")
    fsdp_config: dict[str, Any] | str | None = option(None, "FSDP settings (dict or JSON file).")
    deepspeed: dict | str | None = option(None, "DeepSpeed config (dict or JSON file).")
    debug: str | list[str] = option("", "Debug options (underflow_overflow, tpu_metrics_debug).")
    skip_memory_metrics: bool = option(True, "Skip memory profiling metrics.")

    # Script flags
    do_train: bool = option(False, "Script flag: train (not read by the trainer).")
    do_eval: bool = option(False, "Script flag: evaluate (turned on by an eval_strategy other than no).")
    do_predict: bool = option(False, "Script flag: predict (not read by the trainer).")
    resume_from_checkpoint: str | None = option(None, "Checkpoint to resume from (script flag).")
    local_rank: int = option(-1, "Rank of the process on its node (set by the launcher).")

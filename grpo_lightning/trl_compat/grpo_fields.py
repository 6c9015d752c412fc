"""The GRPO-specific fields of the seed's ``GRPOConfig``, in its order and with its defaults.

Where each field goes in a ``grpo fit`` config: :data:`grpo_lightning.trl_compat.field_map.FIELD_TO_YAML`.

Layer L7 (trl_compat): the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_lightning.trl_compat.fields import option
from grpo_lightning.trl_compat.training_arguments import TrainingArgumentsFields


@dataclass
class GRPOFields(TrainingArgumentsFields):
    """The GRPO half of :class:`~grpo_lightning.trl_compat.GRPOConfig`."""

    # Model and reference model
    model_init_kwargs: dict[str, Any] | str | None = option(
        None, "from_pretrained arguments when the model is given as a path or Hub id (dict or JSON string).")
    trust_remote_code: bool = option(False, "Allow custom model/tokenizer code from the Hub (also for reward models).")
    router_aux_loss_coef: float | None = option(
        None, "MoE load-balancing loss weight; unset: the model config's; 0.0 turns it off.")
    disable_dropout: bool = option(False, "Turn dropout off in the policy (and reference).")
    cast_lm_head_to_fp32: bool = option(False, "Keep the LM head in float32 (untied embeddings only).")

    # Data preprocessing
    num_generations: int | None = option(8, "Completions sampled per prompt (a group); at least 2.")
    num_generations_eval: int | None = option(None, "Completions per prompt in evaluation (unset: num_generations).")
    max_completion_length: int | None = option(512, "Maximum tokens per completion.")
    ds3_gather_for_generation: bool = option(True, "Gather ZeRO-3 weights for generation (faster, needs the memory).")
    shuffle_dataset: bool | None = option(True, "Shuffle the training prompts.")
    pad_to_multiple_of: int | str | None = option(
        "auto", "Pad prompt and completion ids to a multiple of this; auto: 128 on AWS Neuron, none elsewhere.")

    # Generation
    generation_batch_size: int | None = option(
        None, "Completions per generation batch (unset: per_device_train_batch_size x processes x steps_per_generation); "
        "exclusive with steps_per_generation.")
    steps_per_generation: int | None = option(
        None, "Micro-steps trained per generation batch (unset: gradient_accumulation_steps); exclusive with "
        "generation_batch_size.")
    temperature: float = option(1.0, "Sampling temperature (also divides the training logits).")
    top_p: float = option(1.0, "Nucleus sampling mass, in (0, 1].")
    top_k: int = option(0, "Keep only the k most likely tokens; 0 keeps all.")
    min_p: float | None = option(None, "Minimum token probability relative to the most likely token.")
    generation_kwargs: dict | str | None = option(
        None, "Extra GenerationConfig / SamplingParams arguments; they override the fields above.")
    chat_template_kwargs: dict | str | None = option(None, "Extra apply_chat_template arguments.")
    repetition_penalty: float = option(1.0, "Penalty on tokens already in the prompt or completion; 1.0: none.")
    cache_implementation: str | None = option(None, "KV-cache implementation of transformers generate.")

    # vLLM
    use_vllm: bool = option(False, "Generate with vLLM.")
    vllm_mode: str = option("colocate", "vLLM mode: colocate (in the training processes) or server.")
    vllm_model_impl: str = option("vllm", "Model implementation vLLM uses: vllm or transformers.")
    vllm_enable_sleep_mode: bool = option(False, "Offload vLLM weights and cache during optimizer steps.")
    vllm_structured_outputs_regex: str | None = option(None, "Regex that vLLM's structured outputs enforce.")
    vllm_server_base_url: str | None = option(None, "Base URL of the vLLM server (overrides host and port).")
    vllm_server_host: str = option("0.0.0.0", "Host of the vLLM server.")
    vllm_server_port: int = option(8000, "Port of the vLLM server.")
    vllm_server_timeout: float = option(240.0, "Seconds to wait for the vLLM server to come up.")
    vllm_group_port: int = option(51216, "Port of the weight-update group with the vLLM server.")
    vllm_gpu_memory_utilization: float = option(0.3, "GPU memory fraction of a colocated vLLM engine.")
    vllm_max_model_length: int | None = option(None, "Context length of the vLLM engine (unset: the model's).")
    vllm_tensor_parallel_size: int = option(1, "Tensor-parallel size of a colocated vLLM engine.")

    # Training
    beta: float = option(0.0, "KL coefficient; 0.0 loads no reference model.")
    num_iterations: int = option(1, "Times each generation batch is trained on (mu).")
    epsilon: float = option(0.2, "Lower clipping range of the ratio.")
    delta: float | None = option(None, "Upper cap of the ratio in two-sided clipping (INTELLECT-2); unset: none.")
    epsilon_high: float | None = option(None, "Upper clipping range (unset: epsilon; cispo: 5.0, the seed's default).")
    sapo_temperature_neg: float = option(1.05, "sapo gate temperature for non-positive advantages.")
    sapo_temperature_pos: float = option(1.0, "sapo gate temperature for positive advantages.")
    vespo_k_pos: float = option(2.0, "vespo exponent k for positive advantages.")
    vespo_lambda_pos: float = option(3.0, "vespo decay lambda for positive advantages.")
    vespo_k_neg: float = option(3.0, "vespo exponent k for negative advantages.")
    vespo_lambda_neg: float = option(2.0, "vespo decay lambda for negative advantages.")
    importance_sampling_level: str = option("token", "Ratio per token or per sequence (GSPO): token or sequence.")
    reward_weights: list[float] | None = option(None, "Weight of each reward function (unset: all 1.0).")
    multi_objective_aggregation: str = option(
        "sum_then_normalize", "Several rewards: sum_then_normalize, or normalize_then_sum (GDPO).")
    scale_rewards: str = option("group", "Advantage scaling: group, batch or none (true: group, false: none).")
    loss_type: str = option("dapo", "Loss: grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo or vespo.")
    mask_truncated_completions: bool = option(False, "Leave completions cut by max_completion_length out of the loss.")
    sync_ref_model: bool = option(False, "Mix the policy into the reference every ref_model_sync_steps (TR-DPO).")
    ref_model_mixup_alpha: float = option(0.6, "TR-DPO mixing weight alpha of the policy.")
    ref_model_sync_steps: int = option(512, "TR-DPO: optimizer steps between reference updates.")
    top_entropy_quantile: float = option(1.0, "Keep only the top quantile of tokens by entropy in the loss; 1.0: all.")
    entropy_coef: float = option(0.0, "Weight of the entropy bonus (mean entropy per token).")
    use_adaptive_entropy: bool = option(False, "Adapt entropy_coef each step toward entropy_target (Skywork-OR1).")
    entropy_coef_min: float = option(0.0, "Lower bound of the adaptive entropy coefficient.")
    entropy_coef_max: float = option(1.0, "Upper bound of the adaptive entropy coefficient.")
    entropy_coef_delta: float = option(0.005, "Step of the adaptive entropy coefficient.")
    entropy_target: float = option(0.2, "Target mean entropy per token (nats) of the adaptive control.")
    max_tool_calling_iterations: int | None = option(None, "Tool-calling turns per completion; unset: no limit.")
    vllm_importance_sampling_correction: bool = option(
        True, "Correct for the sampler/trainer log-prob gap with importance sampling.")
    vllm_importance_sampling_mode: str = option(
        "sequence_mask", "IS correction: token_truncate, token_mask, sequence_truncate or sequence_mask.")
    vllm_importance_sampling_clip_max: float | None = option(3.0, "Upper bound of the IS ratio.")
    vllm_importance_sampling_clip_min: float | None = option(None, "Lower bound of the IS ratio.")
    off_policy_mask_threshold: float | None = option(
        None, "Mask negative-advantage sequences whose sampler KL exceeds this (DeepSeek-V3.2); unset: off.")
    use_bias_correction_kl: bool = option(True, "Multiply the KL term by the IS ratio (unbiased reverse-KL gradient).")

    # Logging
    log_completions: bool = option(False, "Log sampled (prompt, completion) pairs every logging_steps.")
    log_multimodal: bool = option(True, "Include images and other media in the completion logs.")
    num_completions_to_print: int | None = option(None, "Completions printed to the console (unset: all).")
    log_unique_prompts: bool = option(False, "Log each prompt once.")
    log_completions_hub_repo: str | None = option(None, "Hub dataset repository the completions are uploaded to.")

    # transformers continuous batching
    use_transformers_continuous_batching: bool = option(False, "Generate with transformers' continuous batching.")
    transformers_continuous_batching_config: dict | str | None = option(
        None, "ContinuousBatchingConfig arguments.")

    # Deprecated (accepted with a warning)
    use_transformers_paged: bool = option(False, "Deprecated: use use_transformers_continuous_batching.")
    vllm_importance_sampling_cap: float | None = option(None, "Deprecated: use vllm_importance_sampling_clip_max.")

"""What a memory estimate is computed from: the model's shape and the run's settings (layer L0).

Typed records only; :func:`grpo_lightning.utils.memory_plan.estimate_memory` turns them into a
plan, the ``MemoryPlanner`` callback reads them off a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true"]
Strategy = Literal["single", "ddp", "fsdp", "fsdp2", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"]
Optimizer = Literal["adamw", "adamw_8bit", "sgd", "sgd_momentum", "none"]
SamplerKind = Literal["hf", "vllm_colocate", "external"]


@dataclass(frozen=True)
class ModelShape:
    """The few config numbers memory depends on (a Llama/Qwen2-style decoder)."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a transformers ``PretrainedConfig`` (``head_dim`` defaults to ``h / n_heads``)."""
        h, heads = int(config.hidden_size), int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or h // heads
        bias = getattr(config, "attention_bias", None)
        return cls(
            hidden_size=h, num_layers=int(config.num_hidden_layers), intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size), num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(bias) if bias is not None else getattr(config, "model_type", "") == "qwen2",
        )

    @property
    def q(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        """One decoder layer: q/k/v/o projections, gate/up/down MLP, two RMSNorm weights."""
        h, i = self.hidden_size, self.intermediate_size
        bias = (self.q + 2 * self.kv) if self.attention_bias else 0
        return h * self.q + 2 * h * self.kv + self.q * h + bias + 3 * h * i + 2 * h

    @property
    def embedding_parameters(self) -> int:
        """Input embedding plus the LM head when it is not tied to it."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def num_parameters(self) -> int:
        return self.num_layers * self.layer_parameters + self.hidden_size + self.embedding_parameters


@dataclass(frozen=True)
class MemorySettings:
    """Everything besides the model shape that memory depends on (one rank's view).

    Args:
        trainable_parameters / frozen_parameters: of the policy (PEFT: adapters / base model).
        param_bytes: bytes of a parameter as loaded (``model.dtype``: 4 for float32).
        precision: ``trainer.precision``; ``*-true`` 16-bit converts the weights to 2 bytes.
        optimizer: ``adamw`` (torch), ``adamw_8bit`` (bitsandbytes), ``sgd``/``sgd_momentum``.
        optimizer_foreach: a non-fused multi-tensor optimizer (temporaries the size of its states).
        strategy / world_size: sharding; see ``memory_plan._SHARDS``.
        reference: a separate frozen reference model (``beta != 0`` without PEFT).
        rows: ``per_device_train_batch_size``; prompt_length / completion_length: ``Tp`` / ``Tc``.
        generation_rows: rows one generate call holds (local generation batch or ``max_batch_rows``).
        logprob_rows: rows of one no-grad log-prob pass; ``None`` when no such pass runs.
        gradient_checkpointing, chunked_lm_head, lm_head_chunk_tokens, padding_free,
        train_token_budget, logprob_token_budget: the module's ``model.*``/``model.forward.*``.
        entropy_grad: the entropy bonus is on (``entropy_coef != 0``): its gradient is built too.
        attention: ``fused`` (sdpa/flash kernels: memory linear in ``T``) or ``eager``.
        sampler: ``hf`` (generate on the policy: a KV cache), ``vllm_colocate`` or ``external``.
        generation_weight_casts: an ``hf`` sampler keeps autocast's 16-bit casts of the trainable
            weights for a whole request (its ``cache_weight_casts``; only under ``*-mixed``).
        vllm_gpu_memory_utilization / vllm_kv_cache_bytes / vllm_sleep_mode: the colocated engine.
        device_bytes: the device's memory (for the vLLM share and the report).
        gradients_at_generation: some generation runs inside an accumulation window, with the
            window's gradients alive (``accumulate`` does not divide ``steps_per_generation ×
            num_iterations``, or a validation check falls inside a window); ``False`` when every
            generation starts a window. Default: the upper bound.
    """

    trainable_parameters: int
    frozen_parameters: int = 0
    param_bytes: int = 4
    precision: Precision = "32-true"
    optimizer: Optimizer = "adamw"
    optimizer_foreach: bool = False
    strategy: Strategy = "single"
    world_size: int = 1
    reference: bool = False
    rows: int = 8
    prompt_length: int = 256
    completion_length: int = 512
    generation_rows: int | None = None
    logprob_rows: int | None = None
    gradient_checkpointing: bool = True
    chunked_lm_head: bool = True
    lm_head_chunk_tokens: int = 1024
    padding_free: bool = True
    train_token_budget: int | None = None
    logprob_token_budget: int | None = None
    entropy_grad: bool = False
    attention: Literal["fused", "eager"] = "fused"
    sampler: SamplerKind = "hf"
    generation_weight_casts: bool = False
    vllm_gpu_memory_utilization: float = 0.3
    vllm_kv_cache_bytes: int | None = None
    vllm_sleep_mode: bool = False
    device_bytes: int | None = None
    gradients_at_generation: bool = True

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def weight_bytes(self) -> int:
        """Bytes of a parameter while training: ``*-true`` 16-bit casts the module to 2."""
        if self.precision in ("bf16-true", "16-true"):
            return 2
        return 8 if self.precision == "64-true" else self.param_bytes

    @property
    def compute_bytes(self) -> int:
        """Bytes of matmul inputs/outputs: autocast runs them in 16 bits under ``*-mixed``."""
        return 2 if self.mixed else self.weight_bytes

    @property
    def residual_bytes(self) -> int:
        """Bytes of the residual stream and RMSNorm internals: kept in the weights' dtype (an
        fp32 residual + a bf16 matmul output promotes to fp32 under autocast)."""
        return self.weight_bytes

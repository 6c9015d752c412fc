"""What the optimized forward paths need from a causal LM: its decoder, LM head and logit
transforms (:class:`ModelParts`), found through DDP and PEFT wrappers, and the cost model that
decides how packed rows are laid out.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

log = logging.getLogger("grpo_lightning.module.forward")  # the forward paths' log, as before

# ``config.model_type`` values whose ``*ForCausalLM.forward`` computes
# ``lm_head(base_model(...).last_hidden_state)`` followed at most by a constant scale (Cohere's
# ``logit_scale``, Granite's ``logits_scaling``) or ``final_logit_softcapping`` (Gemma 2/3), and
# whose base model builds its attention mask from ``position_ids`` (packed sequences); checked
# against transformers 5.24. Extend it for another architecture once that holds.
HEAD_MODEL_TYPES: set[str] = {
    "llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral", "ministral", "mixtral",
    "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo2", "smollm3", "starcoder2",
    "granite", "cohere", "gpt2", "gpt_neox",
}  # fmt: skip


@lru_cache(maxsize=None)
def accepts_logits_to_keep(forward_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(forward_cls.forward).parameters


_logged: set[str] = set()


def is_peft_wrapper(model: torch.nn.Module) -> bool:
    return type(model).__module__.split(".")[0] == "peft"


def transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP's ``.module`` and a PEFT wrapper (adapters in its layers)."""
    core = getattr(model, "module", model)
    if is_peft_wrapper(core) and callable(getattr(core, "get_base_model", None)):
        return core.get_base_model()
    return core


def log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


@dataclass(frozen=True)
class ModelParts:
    """What the optimized paths call: the decoder (or ``None``: hidden states from the wrapped
    model's ``output_hidden_states``), the LM head and the post-head logit transforms."""

    base: torch.nn.Module | None
    head: torch.nn.Module
    logit_scale: float | None
    softcap: float | None
    attn_implementation: str
    sliding_window: int | None = None
    # FLOPs of one (query, key) pair of masked attention over those of one token through the
    # decoder's linear layers: how much a wider packed row costs (see _layout_cost).
    attention_pair_cost: float = 0.0


def model_parts(model: torch.nn.Module) -> ModelParts | str:
    """The decoder and head of ``model``, or why the optimized paths cannot use it."""
    core = getattr(model, "module", model)  # DDP-wrapped models expose the real class as .module
    wrapped = core is not model
    if is_peft_wrapper(core):
        peft_config = getattr(core, "active_peft_config", None)
        if peft_config is None or getattr(peft_config, "is_prompt_learning", True):
            return f"{type(core).__name__} is a prompt-learning PEFT model (it changes the inputs)"
        core = transformers_model(core)  # its layers and head carry the adapters
    name = type(core).__name__
    config = getattr(core, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in HEAD_MODEL_TYPES:
        return (
            f"model type {model_type!r} ({name}) is not in grpo_lightning.module.model_parts.HEAD_MODEL_TYPES "
            "(architectures whose logits are lm_head(base_model(...).last_hidden_state))"
        )
    get_head = getattr(core, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    base = getattr(core, "base_model", None)
    if not isinstance(head, torch.nn.Module) or not isinstance(base, torch.nn.Module) or base is core:
        return f"{name} exposes no separate base model and LM head"
    if wrapped:
        if not accepts_logits_to_keep(type(core)):
            return f"wrapped {name} has no logits_to_keep to skip its own head"
        base = None  # calling the inner decoder would bypass the wrapper (DDP hooks)
    logit_scale = None
    if getattr(config, "logit_scale", None) is not None and model_type == "cohere":
        logit_scale = float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None and model_type == "granite":
        logit_scale = 1.0 / float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return ModelParts(
        base=base,
        head=head,
        logit_scale=logit_scale,
        softcap=float(softcap) if softcap else None,
        attn_implementation=str(getattr(config, "_attn_implementation", None)),
        sliding_window=int(window) if window else None,
        attention_pair_cost=attention_pair_cost(config),
    )


def attention_pair_cost(config: Any) -> float:
    """Per layer: a (query, key) pair costs ``4·heads·head_dim`` FLOPs (scores and values), a token
    ``2·(q + k + v + o + MLP)`` weights' worth. MoE configs count their per-token experts' MLPs."""
    hidden = int(config.hidden_size)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    mlp = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None) or 4 * hidden
    experts = int(getattr(config, "num_experts_per_tok", None) or 1)
    linear = 2 * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * int(mlp) * experts)
    return 4 * heads * head_dim / linear


def decoder_cost(rows: int, width: int, parts: ModelParts) -> float:
    """Decoder FLOPs of ``rows`` packed rows of ``width``, in tokens: every slot through the linear
    layers, plus each row's dense ``W²`` attention (mask-based kernels compute every pair)."""
    return rows * width * (1.0 + width * parts.attention_pair_cost)

"""What the data side needs to know about the policy before its weights exist.

The weights are built in ``configure_model`` (so strategies can shard them), but the rollout
builder and the sampler need some facts earlier: which token ids end a completion and how long a
sequence the model can attend over. They come from the model's config files, which are cheap to
read, or from the object itself when the model is given as one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from grpo_lightning.utils.model_config import text_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """Facts about a causal LM that do not need its weights.

    Args:
        generation_eos_token_ids: The EOS ids of the model's generation config (chat models list
            their end-of-turn id here, e.g. Gemma-it's ``<end_of_turn>``); empty when it has none.
        max_context_length: ``max_position_embeddings`` of the config (``None`` when unknown).
    """

    generation_eos_token_ids: tuple[int, ...] = ()
    max_context_length: int | None = None

    def eos_token_ids(self, tokenizer: Any) -> tuple[int, ...]:
        """Every id that ends a completion: the tokenizer's EOS first, then the generation
        config's, without repeats."""
        ids = [tokenizer.eos_token_id, *self.generation_eos_token_ids]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _from_configs(config: Any, generation_config: Any) -> ModelInfo:
    """A vision-language model's context and EOS live in its text config (Qwen2-VL's top-level
    config has no ``max_position_embeddings``): the top level first, then the text config."""
    configs = () if config is None else (config, text_config(config))
    max_length = next((v for c in configs if (v := getattr(c, "max_position_embeddings", None))), None)
    eos = _as_ids(getattr(generation_config, "eos_token_id", None)) if generation_config is not None else ()
    for c in configs:
        eos = eos or _as_ids(getattr(c, "eos_token_id", None))
    return ModelInfo(eos, int(max_length) if max_length else None)


def read_model_info(model: "str | torch.nn.Module", *, trust_remote_code: bool = False) -> ModelInfo:
    """The :class:`ModelInfo` of a model path/hub id (config files only) or a model object."""
    if isinstance(model, torch.nn.Module):
        return _from_configs(getattr(model, "config", None), getattr(model, "generation_config", None))
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(model)
    except (OSError, ValueError):  # no generation_config.json: the model config's EOS applies
        generation_config = None
    return _from_configs(config, generation_config)

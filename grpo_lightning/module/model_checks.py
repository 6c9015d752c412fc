"""Checks of the settings that depend on the model's architecture, from its config, before any
weights load: ``cast_lm_head_to_fp32`` (no tied embeddings, no adapter on ``lm_head``) and
``router_aux_loss_coef`` (resolved to the model's value, refused on a dense model)."""

from __future__ import annotations

from typing import Any

import torch

from grpo_lightning.module.fp32_head import check_fp32_head_setting, has_tied_head, tied_embeddings_error
from grpo_lightning.module.moe_aux import resolve_router_aux_loss_coef
from grpo_lightning.module.peft_settings import LoRASettings


def read_model_config(model: "str | torch.nn.Module", *, trust_remote_code: bool = False) -> Any:
    """The config of a model object, or of a path/hub id (its config file only)."""
    if isinstance(model, torch.nn.Module):
        return getattr(model, "config", None)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)


def _names(value: list[str] | str | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def check_architecture_settings(
    model: "str | torch.nn.Module",
    *,
    cast_lm_head_to_fp32: bool,
    router_aux_loss_coef: float | None,
    peft_config: LoRASettings | None = None,
    trust_remote_code: bool = False,
) -> float:
    """Validate both settings against ``model``; returns the router loss coefficient in use (0: off)."""
    config = read_model_config(model, trust_remote_code=trust_remote_code)
    if cast_lm_head_to_fp32:
        if isinstance(model, torch.nn.Module) and has_tied_head(model):
            raise tied_embeddings_error(type(model).__name__)
        targets = _names(peft_config.target_modules) if peft_config is not None else []
        saved = _names(peft_config.modules_to_save) if peft_config is not None else []
        if config is not None:
            check_fp32_head_setting(config, targets, saved)
    return resolve_router_aux_loss_coef(config, router_aux_loss_coef)

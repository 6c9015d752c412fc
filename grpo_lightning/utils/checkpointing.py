"""Turning activation (gradient) checkpointing on and off across transformers versions."""

from __future__ import annotations

import torch


def is_activation_checkpointing(model: torch.nn.Module) -> bool:
    """Whether ``model`` recomputes activations in backward."""
    probe = getattr(type(model), "is_activation_checkpointing", None)
    if isinstance(probe, property):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def set_activation_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Enable (non-reentrant, as TRL) or disable activation checkpointing on a HF model."""
    if enabled:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()

"""The optimizer and learning-rate schedule: the default AdamW's settings, their conflict with a
configured ``model.optimizer``, and the construction of both for ``configure_optimizers``."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from grpo_lightning.errors import ConfigError

#: GRPOModule's defaults for the built-in AdamW (TRL's learning_rate and weight_decay).
DEFAULT_LEARNING_RATE = 1e-6
DEFAULT_WEIGHT_DECAY = 0.0


def check_optimizer_settings(
    optimizer: Any, learning_rate: float, weight_decay: float, warmup_ratio: float = 0.0, warmup_steps: int = 0
) -> None:
    """Reject a non-positive learning rate, a negative weight decay or warm-up, a warmup ratio outside
    [0, 1), the same in a configured optimizer's ``init_args``, and ``model.learning_rate`` /
    ``model.weight_decay`` set together with ``model.optimizer``.

    They configure the built-in AdamW only; a configured optimizer takes its own ``lr`` and
    ``weight_decay`` from its ``init_args``, so the values would be silently ignored.
    """
    if learning_rate <= 0:
        raise ValueError(f"model.learning_rate={learning_rate}: it must be > 0.")
    if weight_decay < 0:
        raise ValueError(f"model.weight_decay={weight_decay}: it must be >= 0 (0 for none).")
    if not 0.0 <= warmup_ratio < 1.0:
        raise ValueError(f"model.warmup_ratio={warmup_ratio}: use a fraction in [0, 1).")
    if warmup_steps < 0:
        raise ValueError(f"model.warmup_steps={warmup_steps}: it must be >= 0 (0: model.warmup_ratio decides).")
    if optimizer is None:
        return
    _check_optimizer_init_args(getattr(optimizer, "keywords", None) or {})
    ignored = [
        f"model.{name}={value}"
        for name, value, default in (
            ("learning_rate", learning_rate, DEFAULT_LEARNING_RATE),
            ("weight_decay", weight_decay, DEFAULT_WEIGHT_DECAY),
        )
        if value != default
    ]
    if ignored:
        names = " and ".join(setting.split("=")[0] for setting in ignored)
        raise ConfigError(
            f"{' and '.join(ignored)} would be ignored: model.optimizer is set, and {names} only configure the "
            "default AdamW. Give the value in the optimizer's init_args (model.optimizer.init_args.lr, "
            f".weight_decay) and remove {names}."
        )


def _check_optimizer_init_args(init_args: dict[str, Any]) -> None:
    """The configured optimizer's ``lr`` and ``weight_decay`` (the keywords of the factory the CLI
    builds from ``model.optimizer``), checked now instead of by torch once the model is loaded."""
    lr, decay = init_args.get("lr"), init_args.get("weight_decay")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr <= 0:
        raise ValueError(f"model.optimizer.init_args.lr={lr}: it must be > 0.")
    if isinstance(decay, (int, float)) and not isinstance(decay, bool) and decay < 0:
        raise ValueError(f"model.optimizer.init_args.weight_decay={decay}: it must be >= 0 (0 for none).")


def build_optimizer(
    params: list[torch.nn.Parameter],
    factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None,
    *,
    learning_rate: float,
    weight_decay: float,
    lr_scheduler_type: str,
    warmup_steps: int,
    warmup_ratio: float,
    total_steps: int,
) -> dict[str, Any]:
    """``configure_optimizers``' answer: the optimizer (the factory's, or AdamW fused where the
    parameters' device has the kernel, TRL's default too) and a per-step HF schedule over
    ``total_steps`` with ``warmup_steps`` (else ``warmup_ratio`` of the steps) of warm-up."""
    from transformers import get_scheduler

    if factory is not None:
        optimizer = factory(params)
    else:
        optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, fused=fused_adamw_supported(params))
    total_steps = max(total_steps, 1)
    warmup = warmup_steps or math.ceil(warmup_ratio * total_steps)
    scheduler = get_scheduler(lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fused_adamw_supported(params: list[torch.nn.Parameter]) -> bool:
    """Fused AdamW needs floating-point parameters on a device with a fused kernel."""
    if not params:
        return False
    device = params[0].device.type
    return device in ("cuda", "cpu", "xpu", "mps") and all(p.is_floating_point() for p in params)

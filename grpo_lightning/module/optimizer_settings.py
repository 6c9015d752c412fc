"""The default optimizer's settings, and their conflict with a configured ``model.optimizer``."""

from __future__ import annotations

from typing import Any

from grpo_lightning.errors import ConfigError

#: GRPOModule's defaults for the built-in AdamW (TRL's learning_rate and weight_decay).
DEFAULT_LEARNING_RATE = 1e-6
DEFAULT_WEIGHT_DECAY = 0.0


def check_optimizer_settings(optimizer: Any, learning_rate: float, weight_decay: float) -> None:
    """Reject ``model.learning_rate`` / ``model.weight_decay`` set together with ``model.optimizer``.

    They configure the built-in AdamW only; a configured optimizer takes its own ``lr`` and
    ``weight_decay`` from its ``init_args``, so the values would be silently ignored.
    """
    if optimizer is None:
        return
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

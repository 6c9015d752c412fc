"""grpo-lightning: a GRPO trainer for language models on PyTorch Lightning.

``import grpo_lightning`` loads nothing heavy: the TRL-compatible names below are imported on first
use (``grpo_lightning.GRPOConfig``, ``grpo_lightning.GRPOTrainer``, ``grpo_lightning.config_to_yaml``).
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> module that defines it, imported on first access.
_LAZY = {
    "GRPOConfig": "grpo_lightning.trl_compat.config",
    "GRPOTrainer": "grpo_lightning.trl_compat.trainer",
    "config_to_yaml": "grpo_lightning.trl_compat.trainer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'grpo_lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

"""TRL-compatible front door: TRL's names and objects on top of the Lightning trainer.

Layer L7, above ``cli``: ``GRPOTrainer`` runs the config its arguments amount to through the
``grpo fit`` CLI class. ``GRPOConfig`` is TRL's configuration, field for field; where each field
goes in a ``grpo fit`` YAML file is ``field_map.FIELD_TO_YAML``. ``GRPOConfig`` is imported here
eagerly (it is standard-library only); the trainer on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from grpo_lightning.trl_compat.config import GRPOConfig

_LAZY = {"GRPOTrainer": "grpo_lightning.trl_compat.trainer", "config_to_yaml": "grpo_lightning.trl_compat.trainer",
         "TrainerCallbacks": "grpo_lightning.trl_compat.callbacks"}
__all__ = ["GRPOConfig", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'grpo_lightning.trl_compat' has no attribute {name!r}")

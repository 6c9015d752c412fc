"""TRL-compatible front door: TRL's names and objects on top of the Lightning trainer.

Layer L6 (beside ``cli``). ``GRPOConfig`` is TRL's configuration, field for field; where each
field goes in a ``grpo fit`` YAML file is ``field_map.FIELD_TO_YAML``.
"""

from __future__ import annotations

from grpo_lightning.trl_compat.config import GRPOConfig

__all__ = ["GRPOConfig"]

"""The training half: ``GRPOModule`` (policy, reference, loss, optimizer)."""

from grpo_lightning.module.grpo_module import GRPOModule

__all__ = ["GRPOModule"]

"""GRPO policy losses: one class per TRL ``loss_type``, a registry, and a functional entry point.

Layer L1: torch, the standard library, ``grpo_lightning.types`` and ``grpo_lightning.algo`` only.

>>> sorted(LOSSES) == sorted(["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"])
True
>>> get_loss("dapo").beta
0.0
"""

from grpo_lightning.losses.base import PolicyLoss, check_number, off_policy_mask
from grpo_lightning.losses.cispo import CISPOLoss
from grpo_lightning.losses.clipped import (
    BNPOLoss,
    ClippedPolicyLoss,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    LUSPOLoss,
)
from grpo_lightning.losses.entropy_mask import top_entropy_mask
from grpo_lightning.losses.functional import policy_loss
from grpo_lightning.losses.metrics import merge_metrics
from grpo_lightning.losses.records import LossInputs, LossOutput, LossState, MicroBatchTotals, TokenLoss
from grpo_lightning.losses.registry import LOSSES, get_loss
from grpo_lightning.losses.sapo import SAPOLoss
from grpo_lightning.losses.vespo import VESPOLoss

__all__ = [
    "BNPOLoss",
    "CISPOLoss",
    "ClippedPolicyLoss",
    "DAPOLoss",
    "DrGRPOLoss",
    "GRPOLoss",
    "LOSSES",
    "LUSPOLoss",
    "LossInputs",
    "LossOutput",
    "LossState",
    "MicroBatchTotals",
    "PolicyLoss",
    "SAPOLoss",
    "TokenLoss",
    "VESPOLoss",
    "check_number",
    "get_loss",
    "merge_metrics",
    "off_policy_mask",
    "policy_loss",
    "top_entropy_mask",
]

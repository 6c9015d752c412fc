"""``CPUDeepSpeed``: :class:`GRPODeepSpeedStrategy` on DeepSpeed's CPU accelerator, for the tests.

Lightning refuses DeepSpeed without CUDA (``setup_environment``, the device-index check, and
``device_rank=None`` for DeepSpeed); this lifts exactly those three checks. The rest — DeepSpeed's
CPU accelerator (``DS_ACCELERATOR=cpu`` before DeepSpeed is imported), the engine, ZeRO
partitioning, Lightning's loop driving it — is the real code.
"""

from __future__ import annotations

import torch
from lightning.pytorch.strategies.ddp import DDPStrategy

from grpo_lightning.module.deepspeed_strategy import GRPODeepSpeedStrategy


class CPUDeepSpeed(GRPODeepSpeedStrategy):
    """GRPODeepSpeedStrategy with Lightning's three CUDA-only checks lifted (test only)."""

    def __init__(self, *, engine_divides: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.engine_divides = engine_divides  # the negative control: Lightning's plain backward

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # without DeepSpeedStrategy's CUDA check

    def setup_distributed(self) -> None:
        self.set_world_ranks()  # without the CUDA device-index check
        self._init_deepspeed_distributed()

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)  # DeepSpeed wants a device index

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        if self.engine_divides:
            kwargs["scale_wrt_gas"] = True
        return super().backward(closure_loss, optimizer, *args, **kwargs)

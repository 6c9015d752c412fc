"""The data half: prompts, samplers, rewards and advantages behind ``RolloutDataModule``."""

from grpo_lightning.data.datamodule import RolloutDataModule

__all__ = ["RolloutDataModule"]

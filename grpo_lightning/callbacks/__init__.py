"""Lightning callbacks for GRPO runs (selected in YAML under ``trainer.callbacks``)."""

from grpo_lightning.callbacks.completion_logger import CompletionLogger

__all__ = ["CompletionLogger"]

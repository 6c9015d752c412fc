"""Lightning callbacks for GRPO runs (selected in YAML under ``trainer.callbacks``).

``WeightSync`` lives with the data side that owns the sampler (the datamodule adds it by itself
when a sampler keeps its own weights); it is exported here with the other callbacks.
"""

from grpo_lightning.callbacks.adaptive_entropy import AdaptiveEntropy
from grpo_lightning.callbacks.completion_logger import CompletionLogger
from grpo_lightning.callbacks.memory_plan import MemoryPlanner
from grpo_lightning.callbacks.ref_model_sync import RefModelSync
from grpo_lightning.data.weight_sync import WeightSync

__all__ = ["AdaptiveEntropy", "CompletionLogger", "MemoryPlanner", "RefModelSync", "WeightSync"]

"""The read-only properties of ``transformers.TrainingArguments`` that callbacks and scripts read
(``args.world_size``, ``args.should_save``, ``args.device``, ...), and its ``to_json_string`` /
``to_sanitized_dict``, for :class:`~grpo_lightning.trl_compat.GRPOConfig`.

transformers asks accelerate's ``PartialState``, which reads the launcher's ``RANK``, ``WORLD_SIZE``
and ``LOCAL_RANK`` (and starts the process group from them). Building a ``GRPOConfig`` starts
nothing, so these read the process group when one exists, else those variables.

Layer L7 (trl_compat): the standard library only (torch is read only when it is already imported,
or for ``device`` / ``n_gpu``, which are about torch devices).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _process_group() -> Any:
    """``torch.distributed`` when a process group is running, else ``None`` (without importing torch:
    no process group can exist before torch is imported)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "y", "on")


class TrainingArgumentsProperties:
    """Mixin of ``GRPOConfig``: ``TrainingArguments``' properties, computed as transformers does."""

    # Fields of the dataclass this is mixed into.
    per_device_train_batch_size: int
    per_device_eval_batch_size: int
    log_on_each_node: bool
    save_on_each_node: bool
    use_cpu: bool
    gradient_checkpointing: bool
    gradient_checkpointing_kwargs: Any

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - GRPOConfig defines it
        raise NotImplementedError

    # ------------------------------------------------------------------ transformers 5 names
    @property
    def activation_checkpointing(self) -> bool:
        """transformers 5's name of ``gradient_checkpointing`` (which it keeps as a deprecated alias)."""
        return self.gradient_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, value: bool) -> None:
        self.gradient_checkpointing = value

    @property
    def activation_checkpointing_kwargs(self) -> Any:
        """transformers 5's name of ``gradient_checkpointing_kwargs``."""
        return self.gradient_checkpointing_kwargs

    @activation_checkpointing_kwargs.setter
    def activation_checkpointing_kwargs(self, value: Any) -> None:
        self.gradient_checkpointing_kwargs = value

    # ------------------------------------------------------------------ processes
    @property
    def world_size(self) -> int:
        """The number of processes of the run."""
        dist = _process_group()
        return dist.get_world_size() if dist is not None else _env_int("WORLD_SIZE", 1)

    @property
    def process_index(self) -> int:
        """The global rank of this process."""
        dist = _process_group()
        return dist.get_rank() if dist is not None else _env_int("RANK", 0)

    @property
    def local_process_index(self) -> int:
        """The rank of this process on its node (``LOCAL_RANK``: a process group does not know it)."""
        return _env_int("LOCAL_RANK", 0)

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the main process of each node (``log_on_each_node``), else of the run."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes to disk: the main process of each node (``save_on_each_node``),
        else of the run."""
        return (self.local_process_index if self.save_on_each_node else self.process_index) == 0

    # ------------------------------------------------------------------ devices
    def _cpu_only(self) -> bool:
        return bool(self.use_cpu) or _truthy(os.environ.get("ACCELERATE_USE_CPU", "False"))

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 0 on the CPU, 1 per process when distributed, else every visible GPU
        (transformers' count, meant for ``nn.DataParallel``; grpo-lightning runs one process per GPU)."""
        if self._cpu_only():
            return 0
        if self.world_size > 1:
            return 1
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        mps = getattr(torch.backends, "mps", None)
        return 1 if mps is not None and mps.is_available() else 0

    @property
    def device(self) -> Any:
        """The ``torch.device`` of this process (``cuda:<LOCAL_RANK>`` when distributed on GPUs)."""
        import torch

        if self._cpu_only():
            return torch.device("cpu")
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_process_index if self.world_size > 1 else 0)
        mps = getattr(torch.backends, "mps", None)
        return torch.device("mps" if mps is not None and mps.is_available() else "cpu")

    @property
    def parallel_mode(self) -> Any:
        """transformers' ``ParallelMode``: ``DISTRIBUTED`` with several processes, ``NOT_DISTRIBUTED``
        for several GPUs in one process (never used here: one process per GPU), else ``NOT_PARALLEL``."""
        from transformers.training_args import ParallelMode

        if self.world_size > 1:
            return ParallelMode.DISTRIBUTED
        return ParallelMode.NOT_DISTRIBUTED if self.n_gpu > 1 else ParallelMode.NOT_PARALLEL

    @property
    def train_batch_size(self) -> int:
        """transformers' "actual" training batch size: ``per_device_train_batch_size × max(1, n_gpu)``."""
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        """transformers' "actual" evaluation batch size: ``per_device_eval_batch_size × max(1, n_gpu)``."""
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    # ------------------------------------------------------------------ serialisation
    def to_json_string(self) -> str:
        """``to_dict()`` as JSON (indent 2). Values JSON cannot hold (a ``ParallelismConfig`` object)
        are written as their ``str``."""
        return json.dumps(self.to_dict(), indent=2, default=str)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """``to_dict()`` with ``train_batch_size`` / ``eval_batch_size``, every value a bool, int, float,
        str (or tensor) — others as their ``str`` (TensorBoard's hparams)."""
        values = {**self.to_dict(), "train_batch_size": self.train_batch_size, "eval_batch_size": self.eval_batch_size}
        torch = sys.modules.get("torch")
        valid: tuple[type, ...] = (bool, int, float, str, *((torch.Tensor,) if torch is not None else ()))
        return {k: v if type(v) in valid else str(v) for k, v in values.items()}

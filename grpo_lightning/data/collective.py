"""How a rollout builder reaches the other ranks: gathers of tensors and of Python values.

Layer L4 (data side): plain torch with injected callables, so the Lightning datamodule (and
tests, with fake ranks) decide how ranks talk to each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Collective:
    """How a builder reaches the other ranks. ``all_gather(x)`` returns ``(world_size, *x.shape)``."""

    rank: int = 0
    world_size: int = 1
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    all_gather_objects: Callable[[list[Any]], list[list[Any]]] | None = None

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's rows in rank order: ``(L, ...) -> (P*L, ...)``."""
        if self.world_size == 1 or self.all_gather is None:
            return tensor
        gathered = self.all_gather(tensor)
        return gathered.reshape(-1, *tensor.shape[1:])

    def gather_objects(self, values: list[Any]) -> list[Any]:
        """Concatenate every rank's python values in rank order."""
        if self.world_size == 1 or self.all_gather_objects is None:
            return list(values)
        return [v for per_rank in self.all_gather_objects(values) for v in per_rank]


def trainer_collective(trainer: Callable[[], Any]) -> Collective:
    """The :class:`Collective` of a Lightning trainer's ranks: its strategy's ``all_gather`` and
    ``torch.distributed.all_gather_object``. ``trainer`` returns the trainer, looked up at each call."""

    def all_gather_objects(values: list[Any]) -> list[list[Any]]:
        gathered: list[Any] = [None] * trainer().world_size
        torch.distributed.all_gather_object(gathered, values)
        return gathered

    return Collective(trainer().global_rank, trainer().world_size, lambda t: trainer().strategy.all_gather(t),
                      all_gather_objects)


__all__ = ["Collective", "trainer_collective"]

"""What a finished fit lets go of before Lightning's teardown copies it to the host.

When ``fit`` ends, Lightning's ``Strategy.teardown`` moves every optimizer's state and then the
whole module (weights *and* ``.grad``) to the CPU. For a fp32 model with AdamW that is four copies
of the parameters in host memory: on one H200 with Qwen2.5-0.5B, 9.7 GB of anonymous host memory at
the very end of a run whose training never passed 3.2 GB (``docs/gpu.md``). The last step's
gradients are dead weight (the next step would zero them); the optimizer state is only needed to
write a resumable checkpoint after the fit, which a run normally writes *during* the fit. So both
are dropped in ``on_train_end``, after every callback's ``on_train_end`` (``ModelCheckpoint``'s
``save_last`` included) and before the teardown; ``model.keep_optimizer_state_after_fit: true``
keeps the optimizer state for a checkpoint written after ``fit`` returns.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable

import torch

from grpo_lightning.errors import ConfigError

log = logging.getLogger(__name__)


def drop_gradients(parameters: Iterable[torch.nn.Parameter]) -> int:
    """Set every ``.grad`` to None; returns the bytes that were held."""
    held = 0
    for parameter in parameters:
        if parameter.grad is not None:
            held += parameter.grad.numel() * parameter.grad.element_size()
            parameter.grad = None
    return held


def _state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size() if state.dim() else 0  # a step counter: nothing to speak of
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    return 0


def drop_optimizer_states(optimizers: Iterable[Any]) -> tuple[int, int]:
    """Empty the per-parameter state (Adam's moments, ...) of each ``torch.optim.Optimizer``;
    returns (how many optimizers were emptied, the bytes they held). The parameter groups
    (learning rates) stay. Optimizers that keep their state elsewhere (DeepSpeed's ZeRO
    optimizers are not ``torch.optim.Optimizer``s and live on the engine, which the teardown does
    not copy) are left alone."""
    emptied = _torch_optimizers(optimizers)
    held = sum(_state_bytes(dict(optimizer.state)) for optimizer in emptied)
    for optimizer in emptied:
        optimizer.state.clear()
    return len(emptied), held


def _torch_optimizers(optimizers: Iterable[Any]) -> list[torch.optim.Optimizer]:
    return [optimizer for optimizer in optimizers if isinstance(optimizer, torch.optim.Optimizer)]


class TrainingStateRelease:
    """The end-of-training release of one module: drops the gradients, and unless
    ``keep_optimizer_state`` the optimizers' state, and refuses a checkpoint of an optimizer it
    emptied (a later fit builds new optimizers, which checkpoint normally)."""

    def __init__(self, keep_optimizer_state: bool) -> None:
        self.keep_optimizer_state = keep_optimizer_state
        self._emptied: list[weakref.ref] = []

    def release(self, parameters: Iterable[torch.nn.Parameter], optimizers: list[Any]) -> None:
        released = drop_gradients(parameters)
        if not self.keep_optimizer_state:
            _, held = drop_optimizer_states(optimizers)
            released += held
            self._emptied = [weakref.ref(o) for o in _torch_optimizers(optimizers)]
        log.info("Training ended: released %.0f MB of gradients%s", released / 2**20,
                 "" if self.keep_optimizer_state else " and optimizer state")

    def released(self, optimizers: list[Any]) -> bool:
        """Whether one of ``optimizers`` (the trainer's now) had its state emptied."""
        emptied = [ref() for ref in self._emptied]
        return any(o is e for o in optimizers for e in emptied)

    def check_checkpoint(self, optimizers: list[Any]) -> None:
        """Refuse a checkpoint of emptied optimizers: resuming from it would silently restart
        Adam's moments."""
        if self.released(optimizers):
            raise ConfigError(
                "A checkpoint was asked for after fit ended, but the optimizer state was released when training "
                "ended (it would otherwise be copied to host memory by Lightning's teardown), so the checkpoint "
                "could not resume the run exactly. Set model.keep_optimizer_state_after_fit: true to keep it, or "
                "save checkpoints during fit (ModelCheckpoint, trainer.save_checkpoint in a callback's on_train_end)."
            )

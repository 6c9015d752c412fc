"""An applied optimizer step's gradients are dead: drop them at the end of that step.

Lightning zeroes gradients inside the *next* step's closure, after its training forward and right
before its backward. An applied step's gradients would so stay allocated through the next
generation, the no-grad log-prob passes and the next training forward: one more copy of the
trainable parameters (4 bytes each in float32) held by exactly the phases with the large
transients (the KV cache, a colocated vLLM engine waking up, the forward's activations). TRL's HF
Trainer drops them right after ``optimizer.step()`` (``model.zero_grad()``, to None).

:class:`StepGradients` does the same at the end of the batch that took the step: the module calls
it from its own ``on_train_batch_end``, which Lightning runs after every callback's, so callbacks
still see the gradients the step applied (in ``on_before_optimizer_step`` and
``on_train_batch_end``). Inside an accumulation window nothing is dropped. Under DeepSpeed the
engine owns the gradients and zeroes them in its own step; the module does not call this there.
"""

from __future__ import annotations

from typing import Iterable

import torch


class StepGradients:
    """Remembers that an optimizer step was applied, and then sets the gradients to None once."""

    def __init__(self) -> None:
        self._applied = False

    def step_applied(self) -> None:
        """The optimizer step of this batch has run: its gradients are no longer needed."""
        self._applied = True

    def release(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Set every gradient of ``optimizers`` to None, if a step was applied since the last call."""
        if not self._applied:
            return
        self._applied = False
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)

"""Switching a model's train/eval mode for a block, and back exactly."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside the block (no dropout: deterministic, and no draw from the
    global random streams); every submodule's own mode restored after it, not ``model.train()``'s
    blanket one (a frozen part may be in eval mode on purpose)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


__all__ = ["eval_mode"]

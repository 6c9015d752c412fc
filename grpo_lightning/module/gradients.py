"""The step's gradients: their global norm, and clipping by it, under any strategy and precision.

Lightning's own clipping goes through the precision plugin, which refuses fused optimizers under
mixed precision and cannot see a sharded model's whole gradient. The module instead measures the
global norm once, when the step's gradients are complete (that is also the ``grad_norm`` metric),
and clips with it.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def total_grad_norm(parameters: Iterable[torch.nn.Parameter], *, sharded_plain_grads: bool = False) -> float:
    """The L2 norm of all gradients of the whole model, on every rank.

    DTensor gradients (FSDP2) reduce over their mesh; ``sharded_plain_grads`` (FSDP1: each rank
    holds a flat slice as a plain tensor) sums the squares over the default process group. Plain
    full gradients (single device, DDP after its all-reduce) need no communication.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return math.nan
    dtensors = [g for g in grads if _is_dtensor(g)]
    plain = [g for g in grads if not _is_dtensor(g)]
    squares = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    if plain:
        squares = squares + torch.stack([g.detach().float().pow(2).sum() for g in plain]).sum()
        if sharded_plain_grads and torch.distributed.is_initialized():
            torch.distributed.all_reduce(squares)
    if dtensors:
        norm = torch.nn.utils.get_total_norm(dtensors, 2.0)  # a DTensor with partial placement
        squares = squares + (norm.full_tensor() if _is_dtensor(norm) else norm).float().pow(2)
    return float(squares.sqrt())


def scale_grads_(parameters: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every gradient by ``factor`` in place (plain tensors and DTensors alike)."""
    if factor == 1.0:
        return
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(factor)


def clip_by_total_norm_(parameters: list[torch.nn.Parameter], max_norm: float, total_norm: float) -> None:
    """``clip_grad_norm_`` given the already-computed global norm (same coefficient as torch)."""
    if math.isfinite(total_norm):
        scale_grads_(parameters, min(1.0, max_norm / (total_norm + 1e-6)))


def unscale_fused_amp_gradients(precision_plugin: Any, optimizer: torch.optim.Optimizer) -> None:
    """Under fp16 AMP Lightning leaves a fused optimizer's gradients scaled (the optimizer unscales
    inside its step); the norm and clipping need them unscaled, so unscale them now (the scaler's
    step then knows they are)."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        scaler.unscale_(optimizer)


def clip_gradients_(
    parameters: Iterable[torch.nn.Parameter], clip_val: float | None, algorithm: str | None, total_norm: float
) -> None:
    """Lightning's ``gradient_clip_val``/``gradient_clip_algorithm`` (``norm``: by ``total_norm``,
    the global norm measured before; ``value``: elementwise); ``clip_val`` 0/None disables."""
    if not clip_val:
        return
    params = [p for p in parameters if p.grad is not None]
    if algorithm in (None, "norm"):
        clip_by_total_norm_(params, float(clip_val), total_norm)
    else:
        torch.nn.utils.clip_grad_value_(params, float(clip_val))

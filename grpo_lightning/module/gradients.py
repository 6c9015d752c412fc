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
        squares = squares + _sum_of_squares(plain)
        if sharded_plain_grads and torch.distributed.is_initialized():
            torch.distributed.all_reduce(squares)
    if dtensors:
        norm = torch.nn.utils.get_total_norm(dtensors, 2.0)  # a DTensor with partial placement
        squares = squares + (norm.full_tensor() if _is_dtensor(norm) else norm).float().pow(2)
    return float(squares.sqrt())


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ g² over plain gradients, accumulated in float32, as a float32 scalar on their device:
    one foreach norm per (device, dtype) group (a few kernels for the whole model, where a
    per-tensor ``pow(2).sum()`` launched three per parameter and wrote a squared copy of each)."""
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    with torch.no_grad():
        for group in _by_device_and_dtype(grads):
            norms = torch._foreach_norm(group, 2, dtype=torch.float32)  # (len(group),) float32 norms
            total = total + torch.stack(norms).to(total.device).pow(2).sum()
    return total


def scale_grads_(parameters: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every gradient by ``factor`` in place (plain tensors and DTensors alike): plain
    gradients with one foreach kernel per (device, dtype) group."""
    if factor == 1.0:
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    for group in _by_device_and_dtype([g for g in grads if not _is_dtensor(g)]):
        # A float32 0-dim tensor, as clip_grad_norm_ passes it: a Python scalar would be rounded
        # to bfloat16 first by the CPU foreach kernel, unlike ``mul_``.
        torch._foreach_mul_(group, torch.tensor(factor, dtype=torch.float32, device=group[0].device))
    for grad in grads:
        if _is_dtensor(grad):
            grad.mul_(factor)


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


def step_grad_norm(trainer: Any, parameters: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> float:
    """The global norm of a finished step's gradients under ``trainer``'s strategy and precision
    (not DeepSpeed, whose engine keeps its own): fp16 AMP's fused-optimizer gradients unscaled first."""
    unscale_fused_amp_gradients(trainer.precision_plugin, optimizer)
    fsdp1 = type(trainer.strategy).__name__ == "FSDPStrategy"  # flat shards as plain tensors
    return total_grad_norm(parameters, sharded_plain_grads=fsdp1)


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

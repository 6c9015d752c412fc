"""Checking what a reward function returned and turning it into a float32 column (spec §5.2).

Layer L1: pure python/torch, no lightning.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number (bool, int, float, numpy scalar)."""
    return isinstance(value, numbers.Real)


def to_column(name: str, output: Any, n: int, is_model: bool = False) -> torch.Tensor:
    """Check one reward function's return value and convert it to a ``(n,)`` float32 column.

    ``None`` becomes NaN ("not applicable"); a NaN or infinite return is an error, never a silent
    "not applicable" or an infinite advantage.
    """
    if isinstance(output, torch.Tensor):
        if output.dim() != 1:
            raise ValueError(
                f"reward function '{name}' returned a tensor of shape {tuple(output.shape)}; "
                f"it must be 1-D with one value per completion ({n})."
            )
        output = output.detach().cpu().tolist()
    elif type(output).__module__ == "numpy" and hasattr(output, "ndim"):
        if output.ndim != 1:
            raise ValueError(
                f"reward function '{name}' returned an array of shape {output.shape}; "
                f"it must be 1-D with one value per completion ({n})."
            )
        output = output.tolist()
    elif not isinstance(output, (list, tuple)):
        raise TypeError(
            f"reward function '{name}' returned {type(output).__name__}; it must return a list "
            f"with one float (or None) per completion ({n} completions)."
        )
    if len(output) != n:
        raise ValueError(
            f"reward function '{name}' returned {len(output)} values for {n} completions; it must "
            "return exactly one reward (float, or None when not applicable) per completion."
        )
    values = []
    for i, value in enumerate(output):
        if value is None:
            values.append(float("nan"))
        elif isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            values.append(float(value.item()))
        elif isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
            values.append(float(value))
        else:
            raise ValueError(
                f"reward function '{name}' returned {value!r} ({type(value).__name__}) at index "
                f"{i}; each reward must be a real number, or None when it does not apply."
            )
        if value is not None:
            check_finite(name, i, values[-1], is_model)
    return torch.tensor(values, dtype=torch.float32)


def check_finite(name: str, row: int, value: float, is_model: bool) -> None:
    """Rewards are kept in float32: NaN, ±inf and values beyond its range are errors."""
    if math.isfinite(value) and abs(value) <= _FLOAT32_MAX:
        return
    problem = f"{value!r}" if not math.isfinite(value) else f"{value!r}, beyond the float32 range (±3.4e38)"
    if is_model:
        raise ValueError(
            f"reward model '{name}' scored row {row} as {problem}: its logits are not finite. Check "
            "the model's weights and dtype (fp16 overflows easily; try model_init_kwargs: {dtype: "
            "float32} or bfloat16)."
        )
    raise ValueError(
        f"reward function '{name}' returned {problem} for row {row}: rewards must be finite "
        "numbers. Return None (not NaN) for a completion the reward does not apply to, and clip "
        "or rescale unbounded scores."
    )


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

"""Metric bookkeeping with TRL's semantics (spec §4).

Values are appended per generation batch (generation-side metrics) or per micro-step (loss-side
metrics) and, at each log, averaged after dropping NaNs, then cleared. Loss-side metrics are first
reduced exactly across ranks (sums and counts, or min/max), one collective per reduce op.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable

import torch

from grpo_lightning.types import MetricValue

# (tensor, op in {"sum", "min", "max"}) -> reduced tensor; identity on a single process.
AllReduce = Callable[[torch.Tensor, str], torch.Tensor]

# Metrics that are running totals: the latest value is logged, not a mean.
CUMULATIVE_METRICS = frozenset({"num_tokens"})


def reduce_metric_values(metrics: dict[str, MetricValue], all_reduce: AllReduce | None) -> dict[str, float]:
    """Global values of loss-side metrics: ``Σ total / Σ count`` for means, min/max otherwise."""
    out: dict[str, float] = {}
    for op in ("mean", "min", "max"):
        names = [n for n, m in metrics.items() if m.reduce == op]
        if not names:
            continue
        if op == "mean":
            stacked = torch.stack(
                [torch.stack([metrics[n].total.detach().float(), metrics[n].count.detach().float()]) for n in names]
            )  # (M, 2)
            if all_reduce is not None:
                stacked = all_reduce(stacked, "sum")
            for name, (total, count) in zip(names, stacked.tolist()):
                out[name] = total / count if count > 0 else math.nan
        else:
            stacked = torch.stack([metrics[n].total.detach().float() for n in names])  # (M,)
            if all_reduce is not None:
                # NaN means "no value on this rank": make it neutral for the reduction.
                neutral = math.inf if op == "min" else -math.inf
                stacked = all_reduce(torch.nan_to_num(stacked, nan=neutral), op)
            for name, value in zip(names, stacked.tolist()):
                out[name] = value if math.isfinite(value) else math.nan
    return out


class MetricsWindow:
    """Collects metric values between two logging events."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)
        self._latest: dict[str, float] = {}

    def add(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            if name in CUMULATIVE_METRICS:
                self._latest[name] = float(value)
            else:
                self._values[name].append(float(value))

    def __bool__(self) -> bool:
        return bool(self._values) or bool(self._latest)

    def flush(self) -> dict[str, float]:
        """NaN-dropping means of everything added since the last flush (NaN if nothing valid)."""
        out = dict(self._latest)
        for name, values in self._values.items():
            valid = [v for v in values if not math.isnan(v)]
            out[name] = sum(valid) / len(valid) if valid else math.nan
        self._values.clear()
        self._latest.clear()
        return out

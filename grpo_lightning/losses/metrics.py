"""Loss-side metrics as exact local (sum, count) or extreme records (spec §4.2).

TRL reduces ``Σ_ranks Σ(x·m) / Σ_ranks Σ m`` for token metrics and nanmin/nanmax over all ranks'
sequences for the extremes; returning local sums and counts lets the caller reproduce that exactly.
"""

from __future__ import annotations

import torch

from grpo_lightning.algo.stats import nanmax, nanmin
from grpo_lightning.types import MetricValue


def mean_metric(values: torch.Tensor, mask: torch.Tensor, per_sequence: bool = False) -> MetricValue:
    """TRL's ``global_masked_mean`` as local (sum, count).

    ``per_sequence``: ``values`` is ``(B, 1)``, one value per sequence (sequence-level ratios, φ),
    averaged over all rows as TRL does. Otherwise ``values`` is ``(B, T)`` per token, averaged over
    ``mask``. The caller says which: a micro-batch trimmed to width 1 has token tensors of shape
    ``(B, 1)`` too, and inferring the level from the shape would count its masked rows.
    """
    values = values.detach().float()
    if per_sequence:
        return MetricValue(values.sum(), torch.tensor(float(values.shape[0]), device=values.device))
    mask = mask.detach().float()
    return MetricValue((values * mask).sum(), mask.sum())


def sequence_extreme_metric(
    values: torch.Tensor, mask: torch.Tensor, reduce: str, per_sequence: bool = False
) -> MetricValue:
    """Min or max over sequences of the per-sequence masked mean (empty rows ignored, as NaN);
    ``per_sequence`` as in :func:`mean_metric`."""
    values = values.detach().float()
    if per_sequence:
        row_values = values.squeeze(-1)
    else:
        mask = mask.detach().float()
        row_values = (values * mask).sum(-1) / mask.sum(-1)  # (B,) NaN for empty rows, as TRL
    extreme = nanmin(row_values) if reduce == "min" else nanmax(row_values)
    valid = (~torch.isnan(row_values)).sum().float()
    return MetricValue(extreme, valid, reduce=reduce)  # type: ignore[arg-type]


def merge_metrics(parts: list[dict[str, MetricValue]]) -> dict[str, MetricValue]:
    """One micro-step's metrics from those of its parts (a micro-batch scored in pieces):
    sums and counts add up, extremes take the extreme of the parts' (NaN = no value).

    >>> a = {"m": MetricValue(torch.tensor(2.0), torch.tensor(1.0)),
    ...      "hi": MetricValue(torch.tensor(float("nan")), torch.tensor(0.0), "max")}
    >>> b = {"m": MetricValue(torch.tensor(4.0), torch.tensor(3.0)),
    ...      "hi": MetricValue(torch.tensor(0.5), torch.tensor(1.0), "max")}
    >>> merged = merge_metrics([a, b])
    >>> merged["m"].local(), merged["hi"].local()
    (1.5, 0.5)
    """
    merged: dict[str, MetricValue] = {}
    for metrics in parts:
        for name, value in metrics.items():
            seen = merged.get(name)
            if seen is None:
                merged[name] = value
            elif value.reduce == "mean":
                merged[name] = MetricValue(seen.total + value.total, seen.count + value.count)
            else:
                pick = torch.fmin if value.reduce == "min" else torch.fmax  # NaN-ignoring
                merged[name] = MetricValue(pick(seen.total, value.total), seen.count + value.count, value.reduce)
    return merged

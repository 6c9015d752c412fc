"""Completion-length metrics of a global generation batch (spec §4.1)."""

from __future__ import annotations

import torch


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """``completions/*`` metrics.

    Args:
        lengths: ``(N,)`` completion lengths of every rollout on every rank (policy tokens only).
        truncated: ``(N,)`` bool, True where the completion did not end on EOS/pad.

    >>> m = completion_metrics(torch.tensor([3, 5, 8]), torch.tensor([False, False, True]))
    >>> [round(m[k], 4) for k in ("completions/mean_length", "completions/clipped_ratio")]
    [5.3333, 0.3333]
    >>> m["completions/max_terminated_length"]
    5.0
    """
    lengths = lengths.float()
    terminated = lengths[~truncated]
    if terminated.numel() == 0:
        terminated = torch.zeros(1)
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item(),
        "completions/min_terminated_length": terminated.min().item(),
        "completions/max_terminated_length": terminated.max().item(),
    }

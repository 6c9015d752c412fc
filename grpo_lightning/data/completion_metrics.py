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


def tool_metrics(calls: torch.Tensor, failures: torch.Tensor) -> dict[str, float]:
    """``tools/*`` metrics of agent rollouts.

    Args:
        calls: ``(N,)`` tool calls per rollout, every rollout on every rank.
        failures: ``(N,)`` failed calls per rollout (unknown tool, bad arguments, exception, timeout).

    ``tools/call_frequency`` is calls per rollout; ``tools/failure_frequency`` failed calls per
    call (0 without calls). TRL's test: 3 rollouts, 2 calls, one failed:

    >>> m = tool_metrics(torch.tensor([1, 1, 0]), torch.tensor([0, 1, 0]))
    >>> round(m["tools/call_frequency"], 4), m["tools/failure_frequency"]
    (0.6667, 0.5)
    """
    total = float(calls.sum())
    return {
        "tools/call_frequency": total / max(len(calls), 1),
        "tools/failure_frequency": float(failures.sum()) / total if total else 0.0,
    }

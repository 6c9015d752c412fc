"""Aggregation of a per-token loss into the scalar a micro-step backpropagates (spec §3.9).

Every function takes ``per_token_loss`` ``(B, T)`` or ``(B, 1)`` (sequence-level ratios broadcast
against the mask) and ``mask`` ``(B, T)`` float. None of them divides by the gradient accumulation
steps: the loss classes do that, for the families that need it.

The per-micro-batch normalisers (``num_rows``, ``num_tokens``) default to the rows given; a caller
that scores a micro-batch in parts (token-budget training passes) passes the whole micro-batch's
counts, so that the parts' losses sum exactly to the micro-batch's loss.
"""

from __future__ import annotations

import torch


def sequence_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
    """``mean_i [Σ_t L m / max(Σ_t m, 1)]`` (grpo, sapo). Fully masked rows count as 0 in the mean.

    >>> sequence_mean(torch.tensor([[1.0, 3.0], [4.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    tensor(3.)
    >>> sequence_mean(torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 1.0]]), num_rows=2)  # half of a batch
    tensor(1.)
    """
    per_sequence = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
    return per_sequence.sum() / (per_sequence.numel() if num_rows is None else num_rows)


def token_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """``Σ L m / max(Σ m, 1)`` over the local micro-batch (bnpo ``normalizer="micro_batch"``, TRL 1.16).

    >>> token_mean(torch.tensor([[1.0, 3.0], [4.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    tensor(2.6667)
    """
    count = mask.sum() if num_tokens is None else num_tokens.to(mask)
    return (per_token_loss * mask).sum() / count.clamp(min=1.0)


def fixed_length_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, max_completion_length: int, num_rows: int | None = None
) -> torch.Tensor:
    """``Σ L m / (B · max_completion_length)`` (dr_grpo): a constant normaliser, no length bias.

    >>> fixed_length_mean(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), 4)
    tensor(1.)
    """
    rows = per_token_loss.size(0) if num_rows is None else num_rows
    return (per_token_loss * mask).sum() / (rows * max_completion_length)


def global_token_mean(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    num_items_in_batch: torch.Tensor | float | None,
    num_processes: int,
    num_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Σ L m / (max(N, 1) / P)`` (dapo, cispo, vespo; bnpo ``normalizer="step"``).

    ``N`` is the active-token count of everything one optimizer step consumes, on all ranks; each
    rank's loss is scaled so that DDP's gradient average over ``P`` ranks and the sum over
    accumulation steps give the token mean over the step. When ``N`` is ``None`` the micro-batch's
    own token count (``num_tokens``, default ``Σ m``) is used (exact for one process and one
    micro-batch per step).

    >>> global_token_mean(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), 8, 2)
    tensor(1.)
    >>> global_token_mean(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), None, 1)
    tensor(2.)
    """
    if num_items_in_batch is None:
        num_items = mask.sum() if num_tokens is None else num_tokens.to(mask)
    else:
        num_items = torch.as_tensor(
            num_items_in_batch, dtype=per_token_loss.dtype, device=per_token_loss.device
        )
    normalizer = num_items.clamp(min=1.0) / num_processes
    return (per_token_loss * mask).sum() / normalizer


def sequence_sum_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
    """``mean_i [Σ_t L m]`` (luspo, TRL 1.16): at sequence level ``(1/B) Σ_i L_i·|o_i|``.

    >>> sequence_sum_mean(torch.tensor([[2.0], [1.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    tensor(2.5000)
    """
    per_sequence = (per_token_loss * mask).sum(-1)  # (B,)
    return per_sequence.sum() / (per_sequence.numel() if num_rows is None else num_rows)

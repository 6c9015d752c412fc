"""Top-entropy token selection (spec §3.10): train only on the highest-entropy tokens.

The threshold is the ``1 − ρ_H`` quantile of the active tokens' entropies over *all* ranks. TRL
gathers every rank's entropies for one ``torch.quantile`` call; here each rank keeps its own and
:func:`~grpo_lightning.algo.distributed_quantile.distributed_quantile` finds the same threshold
with a fixed number of scalar all-reduces (``all_reduce``), whatever the token count.
"""

from __future__ import annotations

import torch

from grpo_lightning.algo.distributed_quantile import AllReduce, distributed_quantile


def top_entropy_mask(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    top_entropy_quantile: float,
    gathered: torch.Tensor | None = None,
    *,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """Boolean ``(B, T)`` mask of active tokens whose entropy is in the top ``top_entropy_quantile``.

    Args:
        entropies: ``(B, T)`` per-token entropies (read without grad).
        mask: ``(B, T)`` loss mask (1 = active token).
        top_entropy_quantile: Fraction ``ρ_H`` of tokens to keep, in ``[0, 1]``; the threshold is
            the ``1 − ρ_H`` quantile (linear interpolation, as ``torch.quantile``). 0 keeps only
            the maximum-entropy token(s); 1 keeps every active token.
        gathered: 1-D entropies of the active tokens of every rank, already gathered; ``None``
            uses the local active tokens (and ``all_reduce`` across ranks).
        all_reduce: Sums a tensor over ranks (every rank calls this function together); the
            threshold is then the quantile of all ranks' active tokens. ``None``: this process only.

    Returns:
        ``(B, T)`` bool; all False when there is no active token anywhere.

    >>> h = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.3, 9.0]])
    >>> m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    >>> top_entropy_mask(h, m, 0.4).int().tolist()
    [[0, 1, 0], [1, 0, 0]]
    """
    if isinstance(top_entropy_quantile, bool) or not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile={top_entropy_quantile}: it must be in [0, 1].")
    active = mask.bool()
    entropies = entropies.detach()
    if gathered is not None:
        values, all_reduce = gathered.detach().reshape(-1).float(), None
    else:
        values = entropies[active].float()
    threshold = distributed_quantile(values, 1.0 - top_entropy_quantile, all_reduce)  # NaN: no token
    return ((entropies * mask.to(entropies.dtype)) >= threshold.to(entropies.dtype)) & active

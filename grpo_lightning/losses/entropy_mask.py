"""Top-entropy token selection (spec §3.10): train only on the highest-entropy tokens.

The threshold is a quantile over the active tokens of *all* ranks, so the caller gathers the
entropies (``gathered``) and passes them here; on one process the local tokens are used.
"""

from __future__ import annotations

import torch


def top_entropy_mask(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    top_entropy_quantile: float,
    gathered: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean ``(B, T)`` mask of active tokens whose entropy is in the top ``top_entropy_quantile``.

    Args:
        entropies: ``(B, T)`` per-token entropies.
        mask: ``(B, T)`` loss mask (1 = active token).
        top_entropy_quantile: Fraction ``ρ_H`` of tokens to keep, in ``[0, 1]``; the threshold is
            the ``1 − ρ_H`` quantile (linear interpolation). 0 keeps only the maximum-entropy
            token(s); 1 keeps every active token.
        gathered: 1-D entropies of the active tokens of every rank; ``None`` uses the local ones.

    Returns:
        ``(B, T)`` bool; all False when there is no active token anywhere.

    >>> h = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.3, 9.0]])
    >>> m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    >>> top_entropy_mask(h, m, 0.4).int().tolist()
    [[0, 1, 0], [1, 0, 0]]
    """
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile={top_entropy_quantile}: it must be in [0, 1].")
    active = mask.bool()
    values = entropies[active].float() if gathered is None else gathered.float()
    if values.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    threshold = torch.quantile(values, 1.0 - top_entropy_quantile)
    return ((entropies * mask.float()) >= threshold) & active

"""An exact quantile of values spread over ranks, without gathering them.

TRL's top-entropy selection (spec §3.10) all-gathers every active token's entropy and calls
``torch.quantile``: the gathered tensor grows with the world size, and ``torch.quantile`` refuses
inputs above 2^24 elements (spec §12: 64 ranks × 8 rows × 32k tokens already exceed it). Here each
rank keeps its own values and the two order statistics the linear interpolation needs are found
by bisection over the values' IEEE bit patterns: a float maps to an integer key with the same
order, and ``count(key <= mid)`` summed over ranks says on which side of ``mid`` the ``k``-th
smallest value lies. 32 steps pin a float32 value exactly (64 for float64), each step one
all-reduce of two int64 counts; there is no host synchronisation inside the loop.

The result equals ``torch.quantile`` (``interpolation="linear"``) of the concatenation of every
rank's values, bit for bit, wherever ``torch.quantile`` accepts that input; above 2^24 values the
interpolation rank is computed in float64 instead of the input's float32.

Layer L0: pure torch.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

# (tensor, op) -> the tensor reduced over ranks with op "sum" (what Lightning's strategy.reduce does).
AllReduce = Callable[[torch.Tensor, str], torch.Tensor]

_TORCH_QUANTILE_LIMIT = 2**24  # torch.quantile's largest input (and float32's exact integers)
# Per dtype: (signed integer view, mask flipping every bit but the sign, key range in bits).
_KEY_LAYOUT = {
    torch.float32: (torch.int32, 0x7FFFFFFF, 32),
    torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF, 64),
}


def order_keys(values: torch.Tensor) -> torch.Tensor:
    """Signed int64 keys with the order of the float ``values`` (float32 or float64).

    A non-negative float's bit pattern, read as a signed integer, grows with its value; a
    negative float's shrinks, so its bits other than the sign are flipped. ``-0.0`` sorts just
    below ``+0.0``; NaN is not handled (callers remove it).

    >>> x = torch.tensor([-2.0, -0.5, 0.0, 1e-30, 3.0])
    >>> bool((order_keys(x).diff() > 0).all())
    True
    """
    view, flip, _ = _KEY_LAYOUT[values.dtype]
    bits = values.view(view).to(torch.int64)
    return torch.where(bits < 0, bits ^ flip, bits)


def _from_keys(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    view, flip, _ = _KEY_LAYOUT[dtype]
    bits = torch.where(keys < 0, keys ^ flip, keys)
    return bits.to(view).view(dtype)


def _midpoint(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``floor((lo + hi) / 2)`` without int64 overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def _order_statistics(
    keys: torch.Tensor, ranks: torch.Tensor, bits: int, all_reduce: AllReduce | None
) -> torch.Tensor:
    """The keys of the global ``ranks``-th smallest values (0-based), ``(len(ranks),)``.

    Invariant: the answer lies in ``[lo, hi]``; the smallest key whose global count of keys
    ``<= key`` exceeds the rank is the answer, and it is always a key that some rank holds.
    """
    lo = torch.full_like(ranks, -(2 ** (bits - 1)))
    hi = torch.full_like(ranks, 2 ** (bits - 1) - 1)
    for _ in range(bits):
        mid = _midpoint(lo, hi)
        counts = (keys.unsqueeze(0) <= mid.unsqueeze(1)).sum(1)  # (R,) local counts
        if all_reduce is not None:
            counts = all_reduce(counts, "sum")
        enough = counts > ranks
        hi = torch.where(enough, mid, hi)
        lo = torch.where(enough, lo, mid + 1)
    return lo


def distributed_quantile(
    values: torch.Tensor, q: float, all_reduce: AllReduce | None = None
) -> torch.Tensor:
    """The ``q``-quantile (linear interpolation) of the values of every rank together.

    Args:
        values: 1-D float32 or float64 values of this rank (any count, also 0); half-precision
            inputs are promoted to float32.
        q: Quantile in ``[0, 1]``.
        all_reduce: Sums a tensor over ranks (e.g. ``lambda t, op: strategy.reduce(t, reduce_op=op)``);
            ``None`` on one process. Every rank must call this function together (it makes
            ``1 + bits`` collective calls: 33 for float32, 65 for float64).

    Returns:
        A 0-d tensor of the values' dtype on their device: ``torch.quantile(all_values, q)``.
        NaN when there is no value on any rank, or when any rank holds a NaN (as
        ``torch.quantile`` returns for an input with NaN).

    >>> x = torch.tensor([0.5, 0.1, 0.9, 0.3])
    >>> float(distributed_quantile(x, 0.4)) == float(torch.quantile(x, 0.4))
    True
    """
    if not 0.0 <= q <= 1.0 or isinstance(q, bool):
        raise ValueError(f"q={q}: the quantile must be in [0, 1].")
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D; got shape {tuple(values.shape)}.")
    if values.dtype not in _KEY_LAYOUT:
        if not values.is_floating_point():
            raise ValueError(f"values must be floating point; got {values.dtype}.")
        values = values.float()
    dtype, device = values.dtype, values.device
    nan = torch.isnan(values)
    sizes = torch.stack([torch.tensor(values.numel(), device=device), nan.sum()]).to(torch.int64)  # (2,)
    if all_reduce is not None:
        sizes = all_reduce(sizes, "sum")
    total, nans = (int(v) for v in sizes.tolist())  # the one host synchronisation
    if total == 0 or nans > 0:
        return torch.tensor(math.nan, dtype=dtype, device=device)

    # torch.quantile's arithmetic: rank = q·(n−1) in the input dtype, lerp in the input dtype.
    last = total - 1
    if dtype == torch.float32 and last > _TORCH_QUANTILE_LIMIT:
        rank = torch.tensor(q, dtype=torch.float32).double() * last  # float32 cannot hold the rank
    else:
        rank = torch.tensor(q, dtype=dtype) * last
    below = int(rank.floor())
    above = min(int(rank.ceil()), last)
    weight = (rank - below).to(dtype).to(device)

    keys = order_keys(values)
    ranks = torch.tensor([below, above], dtype=torch.int64, device=device)
    found = _from_keys(_order_statistics(keys, ranks, _KEY_LAYOUT[dtype][2], all_reduce), dtype)  # (2,)
    return torch.lerp(found[0], found[1], weight)

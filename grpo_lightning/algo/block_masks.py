"""Attention masks of the packed layouts as *functions of (row, query, key)* and as varlen offsets.

The packed layouts of :mod:`grpo_lightning.algo.packing` and :mod:`grpo_lightning.algo.shared_prefix`
isolate sequences either by position ids restarting at 0 (packed) or by a dense ``(R, 1, W, W)``
mask (shared prompt). Kernels that keep flash-attention speed take the same information in other
forms, built here:

* a ``mask_mod(b, h, q, kv) -> bool`` for ``torch.nn.attention.flex_attention``'s ``BlockMask``
  (only the blocks holding a visible pair are computed);
* cumulative sequence offsets (``cu_seqlens``) for varlen kernels, which see the flattened tokens
  as independent causal sequences (packing without a shared prompt only).

:func:`dense_mask` evaluates a ``mask_mod`` on every pair: the tests compare it with the layouts'
masks exactly. Layer L0: pure torch (``flex_attention`` imported lazily).
"""

from __future__ import annotations

from typing import Callable

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``(R, W)`` id of the sequence each slot belongs to: a new sequence starts wherever the
    position id is 0 (and at the start of every row), ids count up over the flattened rows.

    >>> sequence_ids(torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 0, 0, 1]])).tolist()
    [[0, 0, 0, 1, 1, 2], [3, 3, 4, 5, 6, 6]]
    """
    starts = position_ids == 0
    starts[:, 0] = True
    return starts.flatten().long().cumsum(0).sub(1).view(position_ids.shape)


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Varlen offsets of the sequences of the flattened ``(R, W)`` rows: ``(S + 1,)`` int32
    cumulative lengths and the longest sequence.

    >>> offsets, longest = cu_seqlens(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    >>> offsets.tolist(), longest
    ([0, 3, 5, 6], 3)
    """
    ids = sequence_ids(position_ids).flatten()
    lengths = torch.bincount(ids)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=position_ids.device)
    offsets[1:] = lengths.cumsum(0)
    return offsets, int(lengths.max())


def document_causal_mask_mod(seq_ids: torch.Tensor) -> MaskMod:
    """Causal attention inside each packed sequence: ``kv <= q`` and the same sequence id (``(R, W)``
    ids from :func:`sequence_ids`). Equals the block-diagonal causal mask transformers builds from
    restarting position ids."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (seq_ids[b, q] == seq_ids[b, kv])

    return mask_mod


def dense_mask_mod(mask: torch.Tensor) -> MaskMod:
    """A ``mask_mod`` reading a dense bool ``(R, 1, W, W)`` mask (the shared-prefix layout's), so
    that flex attention computes only the blocks where it has a visible pair."""
    if mask.dtype != torch.bool:  # an additive float mask (eager): 0 = visible
        mask = mask == 0
    rows_mask = mask[:, 0]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return rows_mask[b, q, kv]

    return mask_mod


def dense_mask(mask_mod: MaskMod, rows: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(rows, 1, width, width)`` bool: ``mask_mod`` on every (row, query, key)."""
    b = torch.arange(rows, device=device).view(rows, 1, 1)
    q = torch.arange(width, device=device).view(1, width, 1)
    kv = torch.arange(width, device=device).view(1, 1, width)
    h = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(b, h, q, kv).expand(rows, width, width).unsqueeze(1)


def block_mask(mask_mod: MaskMod, rows: int, width: int, device: torch.device | str, block_size: int = 128):
    """flex attention's ``BlockMask`` of ``mask_mod`` over ``rows × width × width`` (heads broadcast)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, rows, None, width, width, device=device, BLOCK_SIZE=block_size)

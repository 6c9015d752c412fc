"""Padding rollouts into tensors, and shuffling/splitting a generation batch into micro-batches."""

from __future__ import annotations

from typing import Sequence

import torch

from grpo_lightning.types import RolloutBatch


def pad_sequences(
    sequences: Sequence[Sequence[float]], *, value: float, side: str, dtype: torch.dtype = torch.long
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad ragged sequences to ``(R, max_len)``; returns ``(values, mask)``.

    >>> ids, mask = pad_sequences([[1, 2], [3]], value=0, side="left")
    >>> ids.tolist(), mask.tolist()
    ([[1, 2], [0, 3]], [[1, 1], [0, 1]])
    """
    width = max((len(s) for s in sequences), default=0)
    values = torch.full((len(sequences), width), value, dtype=dtype)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if not seq:
            continue
        cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        values[i, cols] = torch.tensor(list(seq), dtype=dtype)
        mask[i, cols] = 1
    return values, mask


def shuffle_and_split(
    batch: RolloutBatch, num_chunks: int, generator: torch.Generator | None
) -> list[RolloutBatch]:
    """One random permutation of the rows, then ``num_chunks`` contiguous micro-batches
    (TRL's ``shuffle_sequence_dict`` + ``split_tensor_dict``), each trimmed of padding."""
    num_rows = len(batch)
    if num_rows % num_chunks:
        raise ValueError(f"{num_rows} rows cannot be split into {num_chunks} equal micro-batches.")
    order = torch.randperm(num_rows, generator=generator) if generator is not None else torch.arange(num_rows)
    size = num_rows // num_chunks
    return [batch.select_rows(order[i * size : (i + 1) * size].to(batch.advantages.device)) for i in range(num_chunks)]


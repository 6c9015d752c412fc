"""Token layouts for the log-prob forward: padded or packed (padding-free), and token-budget groups.

A *layout* says which tokens go into the model, with which position ids, and which hidden
states predict which completion tokens. Both layouts reproduce the plain path exactly on every
real completion token (``completion_mask == 1``): each real token attends to the real tokens
before it in its own row, and its position id is the number of those tokens (the plain path's
``cumsum(mask) - 1``).

Layouts are planned on the host: the batch's ids and masks cross to the CPU in one transfer
(:func:`host_copy`, one device sync on CUDA), every data-dependent step (which tokens are real,
the bin packing, the index maps) runs there, and the finished tensors go back with
``non_blocking`` copies. On a GPU no layout step waits for the kernels already queued (a
boolean-mask index or ``nonzero`` on device tensors would, once each).

Layer L0: pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class TokenLayout:
    """Model inputs plus the index maps between hidden states and completion tokens.

    Attributes:
        input_ids: ``(R, W)`` token ids fed to the model.
        position_ids: ``(R, W)`` position ids.
        attention_mask: ``(R, W)`` padding mask (padded layout), ``None`` for a packed layout,
            where sequences are told apart by position ids restarting at 0, or an ``(R, 1, W, W)``
            mask the model takes as-is (shared-prefix layout, :mod:`grpo_lightning.algo.shared_prefix`).
        predict_index: ``(M,)`` flat index into the ``(R·W)`` hidden states: the state that
            predicts each real completion token.
        target_ids: ``(M,)`` those completion tokens.
        output_index: ``(M,)`` flat index into the ``(B·T)`` completion grid where each result goes.
        host_position_ids: a CPU copy of ``position_ids`` for the packed layouts (the varlen
            kernel's sequence offsets are read from it without a device sync), else ``None``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    predict_index: torch.Tensor
    target_ids: torch.Tensor
    output_index: torch.Tensor
    host_position_ids: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        """Number of completion tokens scored (``M``)."""
        return int(self.target_ids.numel())


def host_copy(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """CPU copies of integer (or 0/1 mask) tensors in one device-to-host transfer (on CPU a copy
    of a few hundred kilobytes: one code path everywhere).

    >>> ids, mask = host_copy(torch.tensor([[5, 6]]), torch.tensor([[True, False]]))
    >>> ids.tolist(), mask.tolist()
    ([[5, 6]], [[True, False]])
    """
    flat = torch.cat([t.reshape(-1).long() for t in tensors]).to("cpu", copy=True)  # the one sync on CUDA
    parts = flat.split([t.numel() for t in tensors])
    return tuple(part.view(t.shape).to(t.dtype) for part, t in zip(parts, tensors))


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-planned tensor on ``device`` without waiting for the device (``non_blocking``)."""
    return tensor.to(device, non_blocking=True)


def is_left_padded(mask: torch.Tensor) -> bool:
    """Every row of ``mask`` is zeros then ones.

    >>> is_left_padded(torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 0]])), is_left_padded(torch.tensor([[1, 0]]))
    (True, False)
    """
    width = mask.shape[1]
    cols = torch.arange(width, device=mask.device)
    expected = cols.unsqueeze(0) >= (width - (mask != 0).sum(1, keepdim=True))
    return bool(((mask != 0) == expected).all())


def is_right_padded(mask: torch.Tensor) -> bool:
    """Every row of ``mask`` is ones then zeros.

    >>> is_right_padded(torch.tensor([[1, 1, 0], [0, 0, 0]])), is_right_padded(torch.tensor([[0, 1]]))
    (True, False)
    """
    cols = torch.arange(mask.shape[1], device=mask.device)
    expected = cols.unsqueeze(0) < (mask != 0).sum(1, keepdim=True)
    return bool(((mask != 0) == expected).all())


def padded_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    host_completion_mask: torch.Tensor | None = None,
) -> TokenLayout:
    """The plain ``(B, Tp+T)`` padded batch, with position ids from the mask, scoring only the
    real completion tokens (index maps from ``host_completion_mask``, a CPU copy of the mask
    when the caller has one; otherwise it is copied here).

    >>> lay = padded_layout(torch.tensor([[0, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]]),
    ...                     torch.tensor([[8, 9], [3, 0]]), torch.tensor([[1, 1], [1, 0]]))
    >>> lay.position_ids.tolist(), lay.predict_index.tolist(), lay.target_ids.tolist(), lay.output_index.tolist()
    ([[0, 0, 1, 2], [0, 1, 2, 2]], [1, 2, 5], [8, 9, 3], [0, 1, 2])
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    prompt_width, total_width = prompt_ids.shape[1], input_ids.shape[1]
    device = completion_ids.device
    host_mask = host_copy(completion_mask)[0] if host_completion_mask is None else host_completion_mask
    rows, cols = (host_mask != 0).nonzero(as_tuple=True)
    output_index = to_device(rows * completion_ids.shape[1] + cols, device)
    return TokenLayout(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        predict_index=to_device(rows * total_width + prompt_width + cols - 1, device),
        target_ids=completion_ids.reshape(-1).index_select(0, output_index),
        output_index=output_index,
    )


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bin-pack item indices by length, longest first, each into the first bin it fits.

    Every bin's total is at most ``max(capacity, max(lengths))``; items keep ascending index
    order inside a bin.

    >>> first_fit_decreasing([5, 3, 4, 2, 1], 6)
    [[0, 4], [2, 3], [1]]
    """
    capacity = max([capacity, *lengths]) if lengths else capacity
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    fill: list[int] = []
    for i in order:
        for b, used in enumerate(fill):
            if used + lengths[i] <= capacity:
                bins[b].append(i)
                fill[b] += lengths[i]
                break
        else:
            bins.append([i])
            fill.append(lengths[i])
    return [sorted(b) for b in bins]


def packed_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    row_tokens: int | None = None,
    pad_token_id: int = 0,
    device: torch.device | None = None,
) -> TokenLayout | None:
    """Padding-free layout: the real tokens of each sequence (prompt + completion), packed end to
    end with position ids restarting at 0 per sequence.

    Rows without a real completion token are left out (nothing of theirs is scored). With
    ``row_tokens=None`` every sequence goes into one row (varlen kernels: flash-attention takes
    ``(1, N)``); otherwise sequences are packed first-fit-decreasing into rows of at most
    ``max(row_tokens, longest sequence)`` tokens, which bounds the attention cost of mask-based
    kernels. Unused slots at the end of a row hold ``pad_token_id`` with position 0, so each is
    its own one-token sequence; no state of theirs is read.

    The layout is planned on CPU copies of the four tensors (one transfer) and placed on
    ``device`` (default: the tensors' own); given CPU copies and the device, nothing is copied back.

    Returns ``None`` when a real completion token is predicted by a padding position of the
    padded batch (a completion after an empty prompt, or a gap in the masks): the plain path
    would then read a padding state, which a packed layout cannot reproduce.

    >>> lay = packed_layout(torch.tensor([[0, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]]),
    ...                     torch.tensor([[8, 9], [3, 0]]), torch.tensor([[1, 1], [1, 0]]))
    >>> lay.input_ids.tolist(), lay.position_ids.tolist(), lay.attention_mask
    ([[5, 8, 9, 6, 7, 3]], [[0, 1, 2, 0, 1, 2]], None)
    >>> lay.predict_index.tolist(), lay.target_ids.tolist(), lay.output_index.tolist()
    ([0, 1, 4], [8, 9, 3], [0, 1, 2])
    """
    device = prompt_ids.device if device is None else device
    prompt_ids, prompt_mask, completion_ids, completion_mask = host_copy(
        prompt_ids, prompt_mask, completion_ids, completion_mask
    )
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, Tp+T)
    real = torch.cat([prompt_mask, completion_mask], dim=1) != 0
    has_completion = (completion_mask != 0).any(1)
    real &= has_completion.unsqueeze(1)  # drop rows with nothing to score
    prompt_width = prompt_ids.shape[1]
    position = real.long().cumsum(1) - 1  # (B, Tp+T): position of each real token
    lengths = real.sum(1).tolist()  # (B,)

    kept = has_completion.nonzero(as_tuple=True)[0].tolist()
    if row_tokens is None:
        bins = [kept] if kept else []
    else:
        bins = [[kept[j] for j in b] for b in first_fit_decreasing([lengths[i] for i in kept], row_tokens)]
    num_rows = max(len(bins), 1)
    row_of, start_of = [0] * len(lengths), [0] * len(lengths)
    width = 1
    for r, members in enumerate(bins):
        offset = 0
        for i in members:
            row_of[i], start_of[i] = r, offset
            offset += lengths[i]
        width = max(width, offset)

    dest = (torch.tensor(row_of) * width + torch.tensor(start_of)).unsqueeze(1) + position  # (B, Tp+T)
    dest = torch.where(real, dest, torch.full_like(dest, -1))
    flat_ids = torch.full((num_rows * width,), pad_token_id, dtype=input_ids.dtype)
    flat_pos = torch.zeros(num_rows * width, dtype=torch.long)
    flat_ids[dest[real]] = input_ids[real]
    flat_pos[dest[real]] = position[real]

    rows, cols = (completion_mask != 0).nonzero(as_tuple=True)
    predictor_cols = prompt_width + cols - 1  # column in the (B, Tp+T) concatenation
    predict_index = torch.where(predictor_cols >= 0, dest[rows, predictor_cols.clamp(min=0)], -1)
    if bool((predict_index < 0).any()):
        return None
    host_positions = flat_pos.view(num_rows, width)
    return TokenLayout(
        input_ids=to_device(flat_ids.view(num_rows, width), device),
        position_ids=to_device(host_positions, device),
        attention_mask=None,
        predict_index=to_device(predict_index, device),
        target_ids=to_device(completion_ids[rows, cols], device),
        output_index=to_device(rows * completion_ids.shape[1] + cols, device),
        host_position_ids=host_positions,
    )


def token_budget_groups(
    prompt_lengths: torch.Tensor,
    completion_lengths: torch.Tensor,
    budget: int,
    *,
    packed: bool = False,
    prompt_units: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Split rows into groups that fit a token budget, longest rows first.

    Rows are sorted by real length ``prompt + completion`` (descending; ties keep index order) and
    a group grows while its size stays within ``budget``: ``rows × (max prompt + max completion)``
    for a padded batch (left-padded prompts, right-padded completions), or the sum of the real
    lengths when ``packed``. A row larger than the budget forms its own group.

    With ``prompt_units`` (a packed forward that shares prompts: one id per row, equal for rows
    with the same prompt) the rows of a unit stay next to each other, largest units first, and a
    group counts each unit's prompt once, so siblings land in the same group and share it there.

    Args:
        prompt_lengths, completion_lengths: ``(B,)`` real tokens of each row.
        budget: maximum tokens of a group.
        packed: size groups by real tokens (padding-free forward) instead of padded size.
        prompt_units: prompt-sharing unit of each row (only with ``packed``).

    Returns:
        Index tensors (on ``prompt_lengths.device``) covering every row exactly once.

    >>> p, c = torch.tensor([2, 2, 5, 2]), torch.tensor([1, 7, 1, 6])
    >>> [g.tolist() for g in token_budget_groups(p, c, 24)]
    [[1, 3], [2, 0]]
    >>> [g.tolist() for g in token_budget_groups(p, c, 24, packed=True)]
    [[1, 3, 2], [0]]
    >>> [g.tolist() for g in token_budget_groups(p, c, 16, packed=True, prompt_units=[0, 0, 1, 0])]
    [[1, 3, 0], [2]]
    """
    prompts, completions = prompt_lengths.tolist(), completion_lengths.tolist()
    units = list(prompt_units) if packed and prompt_units is not None else list(range(len(prompts)))
    unit_size: dict[int, int] = {}
    for i, unit in enumerate(units):
        unit_size[unit] = unit_size.get(unit, int(prompts[i])) + int(completions[i])
    order = sorted(
        range(len(prompts)), key=lambda i: (-unit_size[units[i]], units[i], -(prompts[i] + completions[i]), i)
    )
    groups: list[list[int]] = []
    current: list[int] = []
    seen: set[int] = set()
    max_prompt = max_completion = total = 0
    for i in order:
        p, c = int(prompts[i]), int(completions[i])
        shared_p = 0 if units[i] in seen else p  # a unit's prompt is packed once per group
        if packed:
            size = total + shared_p + c
        else:
            size = (len(current) + 1) * (max(max_prompt, p) + max(max_completion, c))
        if current and size > budget:
            groups.append(current)
            current, seen, max_prompt, max_completion, total = [], set(), 0, 0, 0
            shared_p = p
        current.append(i)
        seen.add(units[i])
        max_prompt, max_completion, total = max(max_prompt, p), max(max_completion, c), total + shared_p + c
    if current:
        groups.append(current)
    return [torch.tensor(g, dtype=torch.long, device=prompt_lengths.device) for g in groups]


def scatter_tokens(values: torch.Tensor, output_index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Place per-token ``values`` ``(M,)`` into a zero ``shape`` grid at flat ``output_index``
    (differentiable w.r.t. ``values``).

    >>> scatter_tokens(torch.tensor([1.0, 2.0]), torch.tensor([3, 0]), (2, 2)).tolist()
    [[2.0, 0.0], [0.0, 1.0]]
    """
    grid = values.new_zeros(shape[0] * shape[1])
    return grid.index_copy(0, output_index, values).view(shape)

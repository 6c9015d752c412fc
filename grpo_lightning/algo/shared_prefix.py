"""Shared-prefix packed layout: a prompt repeated in several rows is forwarded once.

GRPO samples every prompt ``G`` times, so a micro-batch often holds rows with the same prompt.
The padding-free layout (:func:`~grpo_lightning.algo.packing.packed_layout`) packs each row's
prompt + completion separately: a shared prompt goes through the model once per row. Here rows
whose real prompt tokens are identical form one *unit*: one copy of the prompt followed by each
of their completions. A 4-D attention mask lets every completion see the shared prompt and its
own earlier tokens, never a sibling completion; position ids run ``0..P-1`` over the prompt and
``P..P+len-1`` over each completion, so every real completion token sees exactly the keys,
values and positions of the plain path. Completion token 0 of every sibling is predicted from the
prompt's last position (``predict_index`` repeats it; the gather's backward sums the siblings'
gradients, as ``G`` separate forwards would).

The mask is ``(R, 1, W, W)``: bool (``True`` = attend, what ``sdpa`` takes) or additive float32
(0 / most negative, what ``eager`` adds to its scores). Only mask-based attention can use it;
varlen kernels keep the unshared packing.

Layer L0: pure torch.
"""

from __future__ import annotations

from typing import Callable

import torch

from grpo_lightning.algo.packing import (
    TokenLayout, first_fit_decreasing, host_copy, is_right_padded, to_device, token_budget_groups,
)


def prompt_units(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list[int]) -> list[list[int]]:
    """``rows`` grouped by identical real (unmasked) prompt tokens, in order of first appearance.

    >>> ids = torch.tensor([[0, 5, 6], [5, 0, 6], [7, 5, 6], [0, 5, 6]])
    >>> prompt_units(ids, (ids != 0).long(), [0, 1, 2, 3])
    [[0, 1, 3], [2]]
    """
    ids, mask = host_copy(prompt_ids, prompt_mask)
    real = mask != 0
    units: dict[tuple[int, ...], list[int]] = {}
    for i in rows:
        units.setdefault(tuple(ids[i][real[i]].tolist()), []).append(i)
    return list(units.values())


def budget_groups(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    budget: int,
    *,
    packed: bool,
    share_prompts: bool,
) -> list[torch.Tensor]:
    """Rows of a padded batch in token-budget groups (:func:`token_budget_groups`); with
    ``share_prompts`` (a packed forward that shares prompts) the rows of a prompt stay together
    and a group counts that prompt once.

    >>> ids = torch.tensor([[5, 6], [5, 6], [0, 7], [5, 6]])
    >>> groups = budget_groups(ids, (ids != 0).long(), torch.ones(4, 3), 11, packed=True, share_prompts=True)
    >>> [g.tolist() for g in groups]
    [[0, 1, 3], [2]]
    """
    prompt_lengths, completion_lengths = (prompt_mask != 0).sum(1), (completion_mask != 0).sum(1)
    units = None
    if packed and share_prompts:
        units = [0] * prompt_ids.shape[0]
        for unit, members in enumerate(prompt_units(prompt_ids, prompt_mask, list(range(prompt_ids.shape[0])))):
            for row in members:
                units[row] = unit
    return token_budget_groups(prompt_lengths, completion_lengths, budget, packed=packed, prompt_units=units)


def shared_prefix_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    row_tokens: int | None = None,
    max_row_tokens: int | None = None,
    additive_mask: bool = False,
    pad_token_id: int = 0,
    accept: Callable[[int, int], bool] | None = None,
    device: torch.device | None = None,
) -> TokenLayout | None:
    """Packed layout where rows with the same prompt share one copy of it.

    Units (a prompt + the completions sharing it) are packed first-fit-decreasing into rows of at
    most ``max(row_tokens, largest unit)`` tokens (``row_tokens=None``: one row). Rows without a
    real completion token are left out. Unused slots at the end of a row hold ``pad_token_id``
    at position 0 and attend to themselves only.

    Returns ``None`` (use the unshared layouts) when no prompt appears in two rows that have a
    completion (nothing to save); when a real completion token is predicted by a padding position
    of the padded batch (empty prompt, gaps in the masks: as
    :func:`~grpo_lightning.algo.packing.packed_layout`); or when a unit is longer than
    ``max_row_tokens`` (a sliding window: rows are then kept within it, so the window never
    cuts a sequence the plain path sees whole).

    Args:
        prompt_ids, prompt_mask: ``(B, Tp)`` prompts.
        completion_ids, completion_mask: ``(B, T)`` completions.
        row_tokens: target row length (mask-based attention costs ``W²`` per row).
        max_row_tokens: hard limit on a row's length (the model's sliding window), or ``None``.
        additive_mask: a float32 additive mask (``eager``) instead of a bool one (``sdpa``).
        pad_token_id: token of the unused slots.
        accept: called with the planned ``(rows, width)`` before anything is built; ``False``
            returns ``None`` (the caller judged the wider shared rows too costly).
        device: where the layout goes (default: the tensors' own). It is planned on CPU copies
            of the four tensors (one transfer; none when they are given on CPU with ``device``).

    Two rows share the prompt ``[5, 6]``, a third has its own:

    >>> lay = shared_prefix_layout(
    ...     torch.tensor([[5, 6], [5, 6], [0, 7]]), torch.tensor([[1, 1], [1, 1], [0, 1]]),
    ...     torch.tensor([[8, 9], [3, 0], [4, 0]]), torch.tensor([[1, 1], [1, 0], [1, 0]]))
    >>> lay.input_ids.tolist(), lay.position_ids.tolist()
    ([[5, 6, 8, 9, 3, 7, 4]], [[0, 1, 2, 3, 2, 0, 1]])
    >>> lay.predict_index.tolist(), lay.target_ids.tolist(), lay.output_index.tolist()
    ([1, 2, 1, 5], [8, 9, 3, 4], [0, 1, 2, 4])
    >>> lay.attention_mask[0, 0].int().tolist()  # row 1's completion (slot 4) skips row 0's
    [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1, 1]]
    """
    device = prompt_ids.device if device is None else device
    p_ids, p_mask, c_ids, c_mask = host_copy(prompt_ids, prompt_mask, completion_ids, completion_mask)
    p_real, c_real = p_mask != 0, c_mask != 0
    kept = c_real.any(1).nonzero(as_tuple=True)[0].tolist()
    if not kept or p_ids.shape[1] == 0:
        return None
    # The plain path predicts completion token c from column c-1 (token 0: the last prompt
    # column); a packed layout reproduces that only if those columns are real.
    if not bool(p_real[kept, -1].all()) or not is_right_padded(c_real[kept]):
        return None
    units = prompt_units(p_ids, p_real, kept)
    if all(len(members) == 1 for members in units):
        return None
    c_len = c_real.sum(1).tolist()
    p_len = [int(p_real[members[0]].sum()) for members in units]
    unit_len = [p_len[u] + sum(c_len[i] for i in members) for u, members in enumerate(units)]
    capacity = sum(unit_len) if row_tokens is None else row_tokens
    if max_row_tokens:
        if max(unit_len) > max_row_tokens:
            return None
        capacity = min(capacity, max_row_tokens)
    bins = first_fit_decreasing(unit_len, capacity)
    num_rows, width = len(bins), max(sum(unit_len[u] for u in b) for b in bins)
    if accept is not None and not accept(num_rows, width):
        return None

    size = num_rows * width
    flat_ids = torch.full((size,), pad_token_id, dtype=c_ids.dtype)
    flat_pos = torch.zeros(size, dtype=torch.long)
    unit_of = -1 - torch.arange(size)  # pads: a unit of their own
    branch_of = torch.full((size,), -1, dtype=torch.long)  # -1: prompt (seen by the whole unit)
    first_predictor = torch.zeros(c_ids.shape[0], dtype=torch.long)
    start = torch.zeros(c_ids.shape[0], dtype=torch.long)
    for r, members in enumerate(bins):
        offset = r * width
        for u in members:
            p = p_len[u]
            flat_ids[offset : offset + p] = p_ids[units[u][0]][p_real[units[u][0]]]
            flat_pos[offset : offset + p] = torch.arange(p)
            unit_of[offset : offset + unit_len[u]] = u
            last_prompt, offset = offset + p - 1, offset + p
            for branch, i in enumerate(units[u]):
                n = c_len[i]
                flat_ids[offset : offset + n] = c_ids[i, :n]
                flat_pos[offset : offset + n] = torch.arange(p, p + n)
                branch_of[offset : offset + n] = branch
                first_predictor[i], start[i] = last_prompt, offset
                offset += n

    rows, cols = c_real.nonzero(as_tuple=True)
    predict_index = torch.where(cols == 0, first_predictor[rows], start[rows] + cols - 1)
    mask = _unit_mask(to_device(unit_of.view(num_rows, width), device), to_device(branch_of.view(num_rows, width), device))
    if additive_mask:
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill(
            ~mask, torch.finfo(torch.float32).min
        )
    host_positions = flat_pos.view(num_rows, width)
    return TokenLayout(
        input_ids=to_device(flat_ids.view(num_rows, width), device),
        position_ids=to_device(host_positions, device),
        attention_mask=mask,
        predict_index=to_device(predict_index, device),
        target_ids=to_device(c_ids[rows, cols], device),
        output_index=to_device(rows * c_ids.shape[1] + cols, device),
        host_position_ids=host_positions,
    )


def _unit_mask(unit_of: torch.Tensor, branch_of: torch.Tensor) -> torch.Tensor:
    """``(R, 1, W, W)`` bool: query ``q`` sees key ``k <= q`` of its unit that is a prompt token
    (branch -1) or on its own branch."""
    width = unit_of.shape[1]
    cols = torch.arange(width, device=unit_of.device)
    causal = cols.view(1, width, 1) >= cols.view(1, 1, width)
    same_unit = unit_of.unsqueeze(2) == unit_of.unsqueeze(1)
    visible = (branch_of.unsqueeze(1) < 0) | (branch_of.unsqueeze(2) == branch_of.unsqueeze(1))
    return (causal & same_unit & visible).unsqueeze(1)


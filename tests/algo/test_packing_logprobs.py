"""Token layouts of the log-prob forward: padded, packed, token-budget groups."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.algo.packing import (
    first_fit_decreasing,
    is_left_padded,
    is_right_padded,
    packed_layout,
    padded_layout,
    scatter_tokens,
    token_budget_groups,
)


def _batch(prompt_lengths, completion_lengths, tp=None, t=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    tp = tp or max(prompt_lengths)
    t = t or max(max(completion_lengths), 1)
    b = len(prompt_lengths)
    prompt_ids = torch.randint(10, 100, (b, tp), generator=g)
    completion_ids = torch.randint(10, 100, (b, t), generator=g)
    prompt_mask = (torch.arange(tp) >= tp - torch.tensor(prompt_lengths).unsqueeze(1)).long()
    completion_mask = (torch.arange(t) < torch.tensor(completion_lengths).unsqueeze(1)).long()
    return prompt_ids * prompt_mask, prompt_mask, completion_ids * completion_mask, completion_mask


def _sequences(layout):
    """Split each packed row into (ids, positions) runs where positions restart."""
    out = []
    for ids, pos in zip(layout.input_ids.tolist(), layout.position_ids.tolist()):
        run = []
        for i, p in zip(ids, pos):
            if p == 0 and run:
                out.append(run)
                run = []
            run.append(i)
        out.append(run)
    return out


@pytest.mark.parametrize("row_tokens", [None, 1, 20, 1000])
def test_packed_layout_holds_each_real_sequence_once(row_tokens):
    pl, cl = [3, 5, 1, 4, 2], [4, 0, 6, 2, 5]
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(pl, cl)
    layout = packed_layout(
        prompt_ids, prompt_mask, completion_ids, completion_mask, row_tokens=row_tokens, pad_token_id=0
    )
    assert layout is not None and layout.attention_mask is None
    expected = []
    for i in range(len(pl)):
        if cl[i]:
            expected.append(prompt_ids[i, prompt_ids.shape[1] - pl[i]:].tolist() + completion_ids[i, : cl[i]].tolist())
    real = [s for s in _sequences(layout) if s != [0]]  # drop one-token pad slots
    assert sorted(real) == sorted(expected)
    width = layout.input_ids.shape[1]
    longest = max(p + c for p, c in zip(pl, cl) if c)
    if row_tokens is None:
        assert layout.input_ids.shape[0] == 1 and width == sum(p + c for p, c in zip(pl, cl) if c)
    else:
        assert width <= max(row_tokens, longest)
    # every real completion token is predicted by the previous token of its own sequence
    flat = layout.input_ids.reshape(-1)
    rows, cols = completion_mask.nonzero(as_tuple=True)
    prev = torch.where(cols > 0, completion_ids[rows, (cols - 1).clamp(min=0)], prompt_ids[rows, -1])
    assert torch.equal(flat[layout.predict_index], prev)
    assert torch.equal(layout.target_ids, completion_ids[rows, cols])
    assert torch.equal(layout.output_index, rows * completion_ids.shape[1] + cols)


def test_packed_layout_refuses_a_completion_after_an_empty_prompt():
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch([0, 2], [2, 1], tp=2)
    assert packed_layout(prompt_ids, prompt_mask, completion_ids, completion_mask) is None
    # a row with an empty prompt *and* no completion is simply left out
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch([0, 2], [0, 1], tp=2)
    assert packed_layout(prompt_ids, prompt_mask, completion_ids, completion_mask) is not None


def test_padded_layout_matches_the_plain_slicing():
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch([3, 1, 2], [2, 4, 0])
    layout = padded_layout(prompt_ids, prompt_mask, completion_ids, completion_mask)
    tp, t = prompt_ids.shape[1], completion_ids.shape[1]
    # plain: logits[:, -(T+1):-1] → position Tp-1+t predicts completion token t
    grid = torch.arange(layout.input_ids.numel()).view(layout.input_ids.shape)[:, tp - 1 : tp + t - 1]
    assert torch.equal(layout.predict_index, grid[completion_mask.bool()])
    assert torch.equal(layout.position_ids, (torch.cat([prompt_mask, completion_mask], 1).cumsum(1) - 1).clamp(min=0))


def test_padding_checks():
    assert is_left_padded(torch.tensor([[0, 0, 1], [1, 1, 1], [0, 0, 0]]))
    assert not is_left_padded(torch.tensor([[0, 1, 0]]))
    assert is_right_padded(torch.tensor([[1, 0, 0], [0, 0, 0], [1, 1, 1]]))
    assert not is_right_padded(torch.tensor([[1, 0, 1]]))


@pytest.mark.parametrize("capacity", [1, 5, 9, 50])
def test_first_fit_decreasing_respects_capacity(capacity):
    lengths = [7, 3, 3, 5, 1, 8, 2, 2]
    bins = first_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= max(capacity, max(lengths)) for b in bins)


@pytest.mark.parametrize("budget", [1, 30, 64, 200, 10_000])
@pytest.mark.parametrize("packed", [False, True])
def test_token_budget_groups_cover_every_row_within_budget(budget, packed):
    g = torch.Generator().manual_seed(1)
    p, c = torch.randint(1, 20, (17,), generator=g), torch.randint(0, 30, (17,), generator=g)
    groups = token_budget_groups(p, c, budget, packed=packed)
    rows = torch.cat(groups).tolist()
    assert sorted(rows) == list(range(17))
    totals = (p + c).tolist()
    assert [totals[i] for i in rows] == sorted(totals, reverse=True)  # longest first
    for grp in groups:
        size = int((p[grp] + c[grp]).sum()) if packed else len(grp) * int(p[grp].max() + c[grp].max())
        assert size <= budget or len(grp) == 1


def test_scatter_tokens_is_differentiable():
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    grid = scatter_tokens(values, torch.tensor([5, 0, 2]), (2, 3))
    assert grid.tolist() == [[2.0, 0.0, 3.0], [0.0, 0.0, 1.0]]
    (grid * torch.arange(6.0).view(2, 3)).sum().backward()
    assert values.grad.tolist() == [5.0, 0.0, 2.0]

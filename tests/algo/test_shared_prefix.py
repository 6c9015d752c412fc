"""The shared-prefix layout: every real completion token sees exactly the (token, position) context
of the unshared packed layout, siblings never see each other, and a repeated prompt is stored once."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.algo.packing import packed_layout
from grpo_lightning.algo.shared_prefix import prompt_units, shared_prefix_layout


def grouped_batch(groups=((6, (4, 2, 7)), (3, (1, 5)), (5, (3,)), (6, (2, 0))), seed=0, vocab=50):
    """Rows sampled from a few prompts: ``groups`` is ``((prompt length, completion lengths), ...)``;
    the prompts are distinct (the last group repeats the first group's length with other tokens)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths, completion_lengths, prompts = [], [], []
    for p, completions in groups:
        prompt = torch.randint(3, vocab, (p,), generator=g)
        for c in completions:
            prompt_lengths.append(p), completion_lengths.append(c), prompts.append(prompt)
    b, tp, t = len(prompts), max(prompt_lengths), max(completion_lengths)
    prompt_mask = (torch.arange(tp) >= tp - torch.tensor(prompt_lengths).unsqueeze(1)).long()
    completion_mask = (torch.arange(t) < torch.tensor(completion_lengths).unsqueeze(1)).long()
    prompt_ids = torch.zeros((b, tp), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        prompt_ids[i, tp - len(prompt) :] = prompt
    completion_ids = torch.randint(3, vocab, (b, t), generator=g) * completion_mask
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def contexts(layout):
    """For each scored token, in output order: its target and the (token, position) pairs its
    predicting state attends to, in order."""
    ids, pos = layout.input_ids.flatten().tolist(), layout.position_ids.flatten().tolist()
    width = layout.input_ids.shape[1]
    out = {}
    for q, target, o in zip(layout.predict_index.tolist(), layout.target_ids.tolist(), layout.output_index.tolist()):
        row, col = divmod(q, width)
        if layout.attention_mask is None:  # packed: the sequence runs back to the last position 0
            start = col - pos[q]
            keys = [row * width + k for k in range(start, col + 1)]
        else:
            visible = layout.attention_mask[row, 0, col]
            visible = visible if visible.dtype == torch.bool else visible == 0
            keys = [row * width + k for k in visible.nonzero().flatten().tolist()]
        out[o] = (target, [(ids[k], pos[k]) for k in keys])
    return out


@pytest.mark.parametrize("row_tokens", [None, 1, 12, 30])
@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
def test_every_token_sees_the_unshared_context(row_tokens, additive):
    batch = grouped_batch()
    shared = shared_prefix_layout(*batch, row_tokens=row_tokens, additive_mask=additive)
    unshared = packed_layout(*batch, row_tokens=row_tokens)
    assert shared is not None and shared.num_tokens == unshared.num_tokens == int(batch[3].sum())
    assert contexts(shared) == contexts(unshared)


def test_positions_and_predictors_of_a_group():
    batch = grouped_batch(((4, (3, 2, 1)),))
    lay = shared_prefix_layout(*batch)
    prompt = batch[0][0].tolist()
    assert lay.input_ids.shape == (1, 4 + 3 + 2 + 1)
    assert lay.input_ids[0, :4].tolist() == prompt
    assert lay.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5, 4]
    # token 0 of every sibling is predicted by the prompt's last slot (3)
    assert lay.predict_index.tolist() == [3, 4, 5, 3, 7, 3]
    assert lay.output_index.tolist() == [0, 1, 2, 3, 4, 6]
    assert lay.target_ids.tolist() == batch[2][batch[3] != 0].tolist()


def test_mask_isolates_siblings_and_padding_slots():
    batch = grouped_batch(((4, (3, 2)), (2, (1,)), (1, (1,))))
    lay = shared_prefix_layout(*batch, row_tokens=1)  # rows as wide as the largest unit (9)
    mask = lay.attention_mask[:, 0]
    assert lay.attention_mask.dtype == torch.bool and lay.input_ids.shape == (2, 9)
    # row 0: prompt 0..3, sibling A 4..6, sibling B 7..8
    assert mask[0, 7].tolist() == [True] * 4 + [False] * 3 + [True, False]
    assert mask[0, 6].tolist() == [True] * 7 + [False] * 2
    assert not mask[0, :4, 4:].any()  # the prompt sees no completion
    # row 1: units of 3 and 2 tokens, then 4 padding slots that see themselves only
    assert mask[1, 3].tolist() == [False] * 3 + [True] + [False] * 5
    for slot in range(5, 9):
        assert mask[1, slot].nonzero().flatten().tolist() == [slot]
    assert lay.input_ids[1, 5:].tolist() == [0] * 4 and lay.position_ids[1, 5:].tolist() == [0] * 4
    assert mask.diagonal(dim1=1, dim2=2).all()  # no empty attention row


def test_additive_mask_is_float_zero_or_most_negative():
    batch = grouped_batch()
    bool_mask = shared_prefix_layout(*batch).attention_mask
    additive = shared_prefix_layout(*batch, additive_mask=True).attention_mask
    assert additive.dtype == torch.float32
    assert torch.equal(additive == 0, bool_mask)
    assert (additive[~bool_mask] == torch.finfo(torch.float32).min).all()


def test_repeated_prompt_is_stored_once():
    groups = ((6, (4, 2, 7)), (3, (1, 5)), (5, (3,)))
    batch = grouped_batch(groups)
    shared, unshared = shared_prefix_layout(*batch), packed_layout(*batch)
    saved = sum((len(c) - 1) * p for p, c in groups)  # 2·6 + 1·3
    real = int(batch[1].sum() + batch[3].sum())
    assert int((unshared.input_ids != 0).sum()) == real
    assert int((shared.input_ids != 0).sum()) == real - saved == shared.input_ids.numel()  # one row: no pad


def test_rows_respect_row_tokens_and_window():
    batch = grouped_batch(((3, (2, 2)), (2, (3,)), (4, (1, 1)), (1, (2,))))  # units of 7, 5, 6, 3 tokens
    lay = shared_prefix_layout(*batch, row_tokens=8)
    assert lay.input_ids.shape == (3, 8)  # FFD: [7], [6], [5, 3]
    capped = shared_prefix_layout(*batch, row_tokens=100, max_row_tokens=7)
    assert capped.input_ids.shape[1] <= 7
    assert contexts(capped) == contexts(packed_layout(*batch))
    assert shared_prefix_layout(*batch, max_row_tokens=6) is None  # a unit longer than the window


def test_returns_none_when_nothing_is_shared_or_unreproducible():
    assert shared_prefix_layout(*grouped_batch(((3, (2,)), (4, (1,)), (2, (3,))))) is None
    # the only sibling with a completion token is alone
    assert shared_prefix_layout(*grouped_batch(((3, (2, 0, 0)), (4, (1,))))) is None
    # an empty prompt: token 0 would be predicted from a padding position
    assert shared_prefix_layout(*grouped_batch(((0, (2, 1)), (2, (1, 1))))) is None
    # a gap in a completion mask
    batch = list(grouped_batch(((3, (3, 3)),)))
    batch[3] = torch.tensor([[1, 0, 1], [1, 1, 1]])
    assert shared_prefix_layout(*batch) is None
    # nothing to score
    batch = grouped_batch(((3, (0, 0)),))
    assert shared_prefix_layout(*batch) is None


def test_prompts_with_other_padding_share():
    ids = torch.tensor([[0, 5, 6], [5, 0, 6], [0, 5, 7]])
    mask = (ids != 0).long()
    assert prompt_units(ids, mask, [0, 1, 2]) == [[0, 1], [2]]
    completions = torch.tensor([[8, 9], [4, 0], [3, 3]])
    lay = shared_prefix_layout(ids, mask, completions, (completions != 0).long())
    assert lay.input_ids.tolist() == [[5, 6, 8, 9, 4, 5, 7, 3, 3]]
    assert contexts(lay) == contexts(packed_layout(ids, mask, completions, (completions != 0).long()))


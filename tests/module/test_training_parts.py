"""``training_parts``: how a micro-batch is cut for ``forward.train_token_budget``."""

from __future__ import annotations

import torch

from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.module.training_parts import training_parts
from grpo_lightning.types import RolloutBatch
from tests.algo.test_shared_prefix import grouped_batch

# (prompt length, completion lengths) per prompt: 3 + 2 + 1 samples.
GROUPS = ((6, (4, 2, 7)), (3, (1, 5)), (5, (3,)))


def make_batch() -> RolloutBatch:
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch(GROUPS)
    rows = prompt_ids.shape[0]
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, advantages=torch.arange(rows, dtype=torch.float32),
        num_items_in_batch=completion_mask.sum().float(), policy_versions=torch.zeros(rows, dtype=torch.long),
        old_logps=-torch.rand(rows, completion_ids.shape[1]),
    )


def real_rows(part: RolloutBatch) -> list[tuple]:
    """Each row as (advantage, real prompt tokens, real completion tokens): identity of a row."""
    return [
        (float(a), tuple(p[pm.bool()].tolist()), tuple(c[cm.bool()].tolist()))
        for a, p, pm, c, cm in zip(part.advantages, part.prompt_ids, part.prompt_mask, part.completion_ids,
                                   part.completion_mask)
    ]


def test_without_a_budget_the_micro_batch_is_one_part():
    batch = make_batch()
    assert training_parts(batch, ForwardOptions()) == [batch]


def test_parts_cover_every_row_once_within_the_budget_and_keep_prompts_together():
    batch = make_batch()
    parts = training_parts(batch, ForwardOptions(train_token_budget=16))
    assert len(parts) > 1
    rows = [row for part in parts for row in real_rows(part)]
    assert sorted(rows) == sorted(real_rows(batch))
    for part in parts:
        prompts = {row[1] for row in real_rows(part)}
        tokens = sum(len(p) for p in prompts) + int(part.completion_mask.sum())  # a shared prompt counts once
        assert tokens <= 16 or len(part) == 1
        # trimmed: no all-padding column is kept
        assert bool(part.prompt_mask[:, 0].any()) and bool(part.completion_mask[:, -1].any())
        assert part.old_logps.shape == part.completion_ids.shape
    # the two samples of the 3-token prompt (9 tokens with the prompt once) stay in one part
    owners = [i for i, part in enumerate(parts) for row in real_rows(part) if len(row[1]) == 3]
    assert len(set(owners)) == 1


def test_padded_parts_are_sized_by_rows_times_width():
    batch = make_batch()
    parts = training_parts(batch, ForwardOptions(padding_free=False, train_token_budget=24))
    assert sorted(row for part in parts for row in real_rows(part)) == sorted(real_rows(batch))
    for part in parts:
        width = part.prompt_ids.shape[1] + part.completion_ids.shape[1]
        assert len(part) * width <= 24 or len(part) == 1

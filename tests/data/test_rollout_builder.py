"""The rollout builder's cross-rank reductions and its checks, with fake ranks in threads."""

from __future__ import annotations

import pytest

from grpo_lightning.data.rollout_builder import Collective
from tests.data.fake_ranks import FakeHandle, ThreadRanks, make_builder


def logging_reward(completions, hit, log_metric, **kwargs):
    for h in hit:
        if h is None:
            log_metric("misses", 1.0)  # only rank 1 has rows without a hit
        else:
            log_metric("acc", h)
    return [float(len(c)) for c in completions]


def test_log_metric_is_weighted_by_count_across_ranks():
    # rank 0 logs acc = 1, 1, 1, 0 (mean 0.75); rank 1 logs acc = 0 once (mean 0).
    # TRL 1.16: sum / count over ranks = 3 / 5, not the mean of the rank means (0.375).
    hits = {0: [1.0, 1.0, 1.0, 0.0], 1: [0.0, None, None, None]}
    ranks = ThreadRanks(2)

    def build(rank):
        builder = make_builder([logging_reward], ranks.collective(rank))
        row_ids = [2 * rank, 2 * rank, 2 * rank + 1, 2 * rank + 1]
        rows = [{"prompt": f"{i}+1=", "hit": h} for i, h in zip(row_ids, hits[rank])]
        return builder.build(rows, row_ids, None).micro_batches[0].generation_metrics

    metrics = ranks.run(build)
    for rank_metrics in metrics:
        assert rank_metrics["acc"] == pytest.approx(3 / 5)
        assert rank_metrics["misses"] == 1.0  # logged on one rank only: no hang, its own mean


def test_prompt_too_long_for_the_context_names_rows_lengths_and_fix():
    handle = FakeHandle(max_context_length=12)
    builder = make_builder([logging_reward], Collective(), handle=handle, max_completion_length=6)
    rows = [{"prompt": p, "hit": 1.0} for p in ["1+1=", "1+1=", "123456789+1=", "123456789+1="]]
    with pytest.raises(ValueError) as err:
        builder.build(rows, [0, 0, 7, 7], None)
    message = str(err.value)
    assert "row 7 (12 tokens)" in message and "row 0" not in message
    assert "data.generation.max_completion_length=6" in message and "context of 12 tokens" in message
    assert "filter" in message
    # Without a stated context (a handle without the property, or None) nothing is checked.
    handle.max_context_length = None
    assert len(builder.build(rows, [0, 0, 7, 7], None).micro_batches[0]) == 4

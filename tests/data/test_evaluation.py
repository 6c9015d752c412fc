"""Evaluation plans: with several ranks the wrapped prompts keep ranks in step but never count."""

from __future__ import annotations

import threading

import pytest
import torch

from grpo_lightning.data.evaluation import EvalPlan, EvalStream
from tests.data.fake_ranks import ThreadRanks, make_builder

G = 2
VALUES = [1.0, 10.0, 100.0, 1000.0, 10000.0]  # prompt i is worth VALUES[i]


def text_length(prompt: int, j: int) -> int:
    """Characters of completion ``j`` of prompt ``prompt`` (``EchoSampler``; the prompt has prompt + 2)."""
    return 1 + (prompt + 2 + j) % 3


def test_wrapped_prompts_are_marked_as_repeats():
    plan = EvalPlan(num_rows=5, prompts_per_rank=2, world_size=2)
    steps = [[(plan.indices(s, r), plan.repeats(s, r)) for r in range(2)] for s in range(plan.num_steps)]
    assert steps == [
        [((0, 1), (False, False)), ((2, 3), (False, False))],
        [((4, 0), (False, True)), ((1, 2), (True, True))],
    ]
    assert EvalPlan(5, 2, 1).repeats(2, 0) == (False,)  # one rank: a short last step, nothing repeated


def test_with_two_ranks_every_prompt_counts_exactly_once():
    plan = EvalPlan(num_rows=len(VALUES), prompts_per_rank=1, world_size=2)  # steps: (0,1) (2,3) (4,0*)
    ranks = ThreadRanks(2)
    scored: list[float] = []
    lock = threading.Lock()

    def value_reward(completions, value, log_metric, **kwargs):
        with lock:
            scored.extend(value)
        for v in value:
            log_metric("accuracy", float(v >= 100))
        return [v + len(c) for v, c in zip(value, completions)]  # varies within a group

    def evaluate(rank):
        builder = make_builder([value_reward], ranks.collective(rank), num_generations=G, local_rows=G)
        out = []
        for ref in EvalStream("", plan, rank):
            row_ids, counts = ref.rows(G)
            rows = [{"prompt": "1" * (i + 1) + "=", "value": VALUES[i]} for i in row_ids]
            built = builder.build(rows, row_ids, None, counts=counts)
            out.append(built.micro_batches[0])
        return out

    rank0, rank1 = ranks.run(evaluate)
    # Reward functions never see the repeated prompt: each prompt is scored G times in all.
    assert sorted(scored) == sorted(v for v in VALUES for _ in range(G))
    metrics = [batch.generation_metrics for batch in rank0]
    assert [m == b.generation_metrics for m, b in zip(metrics, rank1)] == [True] * 3
    expected = [sum(VALUES[i] + text_length(i, j) for i in prompts for j in range(G)) / (G * len(prompts))
                for prompts in ([0, 1], [2, 3], [4])]  # the last step: prompt 4 alone, not the repeated 0
    assert [m["rewards/value_reward/mean"] for m in metrics] == pytest.approx(expected)
    assert [m["reward"] for m in metrics] == pytest.approx(expected)
    assert [m["accuracy"] for m in metrics] == [0.0, 1.0, 1.0]
    assert metrics[2]["frac_reward_none"] == 0.0 and metrics[2]["rewards/value_reward/frac_none"] == 0.0
    lengths = [text_length(4, j) + 1 for j in range(G)]  # lengths count the EOS token
    assert metrics[2]["completions/mean_length"] == pytest.approx(sum(lengths) / G)
    assert metrics[2]["completions/max_length"] == max(lengths)
    # The repeated rows have no advantage and no loss tokens; the token normaliser counts rank 0's only.
    last0, last1 = rank0[2], rank1[2]
    assert last1.completion_mask.sum() == 0 and torch.all(last1.advantages == 0)
    assert last0.completion_mask.sum() > 0 and torch.any(last0.advantages != 0)
    assert float(last1.num_items_in_batch) == float(last0.num_items_in_batch) == float(last0.loss_mask.sum())
    assert last0.prompt_ids.shape[0] == last1.prompt_ids.shape[0] == G
    # eval_loss weighs a step by its counted rows (HF drops the padded repeats before its mean)
    assert [b.counted.tolist() for b in (rank0[0], rank1[0])] == [[True] * G] * 2
    assert last0.counted.tolist() == [True] * G and last1.counted.tolist() == [False] * G

"""The generation buffer holds every generation batch of the open accumulation window, and a
checkpoint's copy of them restores exactly (older checkpoints' single batch included)."""

from __future__ import annotations

import torch

from grpo_lightning.data.generation_buffer import GenerationBuffer
from grpo_lightning.data.micro_steps import MicroStepRef
from grpo_lightning.data.resume_state import rng_snapshot
from grpo_lightning.types import RolloutBatch


def batch(tag: float) -> RolloutBatch:
    return RolloutBatch(prompt_ids=torch.ones(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3),
                        completion_ids=torch.full((2, 4), 5), completion_mask=torch.ones(2, 4),
                        advantages=torch.tensor([tag, -tag]), num_items_in_batch=torch.tensor(8.0),
                        policy_versions=torch.zeros(2, dtype=torch.long), generation_metrics={"reward": tag})


def at(key, window_key):
    """Micro-step refs of generation batch ``key``'s first micro-step, and of its window's start
    (the first micro-step of ``window_key``): one micro-step per generation batch."""
    return (MicroStepRef(key[1], key[0], key[1], 0, 0),
            MicroStepRef(window_key[1], window_key[0], window_key[1], 0, 0))


def generator(log: list):
    def generate(key):
        def run():
            log.append(key)
            return [batch(float(key[1])), batch(float(key[1]) + 0.5)]
        return run
    return generate


def test_batches_before_the_open_window_are_dropped_and_the_rest_kept():
    made, buffer = [], GenerationBuffer()
    generate = generator(made)
    buffer.batches_for(*at((0, 0), (0, 0)), generate((0, 0)), "cpu")
    buffer.batches_for(*at((0, 1), (0, 0)), generate((0, 1)), "cpu")  # a window spanning two generation batches
    assert list(buffer.held) == [(0, 0), (0, 1)] and buffer.key == (0, 1)
    assert buffer.batches_for(*at((0, 0), (0, 0)), generate((0, 0)), "cpu")[1] is False  # held: not again
    buffer.batches_for(*at((0, 2), (0, 2)), generate((0, 2)), "cpu")
    assert list(buffer.held) == [(0, 2)] and made == [(0, 0), (0, 1), (0, 2)]


def test_a_replayed_window_restores_every_held_batch_and_logs_their_generation_metrics_again():
    buffer, made = GenerationBuffer(), []
    generate = generator(made)
    for key in [(1, 3), (1, 4)]:
        buffer.batches_for(*at(key, (1, 3)), generate(key), "cpu")
    state = buffer.rank_state(resume_at=3)

    for replay in (True, False):
        restored = GenerationBuffer()
        restored.resume_from(state, replay=replay)
        batches, unlogged = restored.batches_for(*at((1, 3), (1, 3)), generate((1, 3)), "cpu")
        assert [b.advantages.tolist() for b in batches] == [[3.0, -3.0], [3.5, -3.5]] and unlogged is replay
        assert restored.batches_for(*at((1, 4), (1, 3)), generate((1, 4)), "cpu")[1] is replay
        assert restored.batches_for(*at((1, 4), (1, 3)), generate((1, 4)), "cpu")[1] is False  # once only
    assert made == [(1, 3), (1, 4)]  # restored, never regenerated


def test_a_checkpoint_from_before_several_batches_were_held_still_restores():
    old_format = {"rng": rng_snapshot(), "buffer_key": [0, 2], "buffer": [vars(batch(2.0)).copy()]}
    buffer, made = GenerationBuffer(), []
    buffer.resume_from(old_format, replay=True)
    batches, unlogged = buffer.batches_for(*at((0, 2), (0, 2)), generator(made)((0, 2)), "cpu")
    assert unlogged and made == [] and batches[0].advantages.tolist() == [2.0, -2.0]

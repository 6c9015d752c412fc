"""Where a checkpoint falls in an accumulation window, and the rewind of Lightning's batch progress."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo_lightning.utils.accumulation_window import micro_steps_into_window, rewind_batch_progress


def trainer(processed: int, accumulate: int, batches: int = 10) -> SimpleNamespace:
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
                           accumulate_grad_batches=accumulate, num_training_batches=batches)


@pytest.mark.parametrize("processed, accumulate, expected", [
    (0, 4, 0), (3, 4, 3), (4, 4, 0), (9, 4, 1),
    (10, 4, 0),  # the epoch's end: Lightning stepped its short last window
    (7, 1, 0),  # no accumulation: every micro-step is an optimizer step
])
def test_micro_steps_into_the_open_window(processed, accumulate, expected):
    assert micro_steps_into_window(trainer(processed, accumulate)) == expected


def test_a_trainer_without_a_fit_loop_is_at_no_window():
    assert micro_steps_into_window(SimpleNamespace(accumulate_grad_batches=4)) == 0


def test_the_rewind_sets_every_counter_to_the_window_start():
    def counters(ready, processed, completed):
        return {"ready": ready, "started": ready, "processed": processed, "completed": completed}

    # a failure in micro-step 7 (in flight), two micro-steps into its window (5, 6 trained)
    loops = {"fit_loop": {"epoch_loop.batch_progress": {
        "total": counters(27, 26, 26), "current": counters(8, 7, 7), "is_last_batch": True}}}
    rewind_batch_progress(loops, 2)
    progress = loops["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["current"] == counters(5, 5, 5) and progress["total"] == counters(24, 24, 24)
    assert progress["is_last_batch"] is False
    untouched = {"fit_loop": {"epoch_loop.batch_progress": {"current": counters(8, 7, 7)}}}
    rewind_batch_progress(untouched, 0)
    assert untouched["fit_loop"]["epoch_loop.batch_progress"]["current"] == counters(8, 7, 7)

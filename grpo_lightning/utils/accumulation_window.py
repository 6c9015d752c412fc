"""A checkpoint written inside a gradient-accumulation window resumes at the window's start.

Periodic checkpoints fall at optimizer-step ends. One written inside an accumulation window (an
``on_exception.ckpt`` after a failure in a micro-step, a ``trainer.save_checkpoint`` from a user's
hook) cannot keep the gradients gathered so far: a failure inside a backward leaves them partial,
and they are as large as the model. The weights and the optimizer are the same throughout a
window, though, so the checkpoint is rewound to the window's start instead, and the resumed run
trains the whole window again: the optimizer steps on the gradients of all its micro-steps, as in
a run that never stopped. Three parts move together:

* the datamodule resumes at the window's first micro-step (its generation batches are kept in
  the checkpoint, so they are replayed, not regenerated);
* the module's metrics are saved as of the last optimizer step (the window's are gathered again);
* Lightning's batch progress is rewound to the window's start (:func:`rewind_batch_progress`,
  applied by ``module/restart_points.py``).

The module and the datamodule are sibling layers that never import each other: both read the
window from Lightning's counters through :func:`micro_steps_into_window`, so they agree. No
lightning import: the trainer is read by attribute.
"""

from __future__ import annotations

from typing import Any

#: Lightning's batch-progress counters, each of which a rewind sets back.
_COUNTERS = ("ready", "started", "processed", "completed")


def micro_steps_into_window(trainer: Any) -> int:
    """Micro-steps of the open accumulation window finished so far: 0 at an optimizer step's end
    (every periodic checkpoint), and at an epoch's end, where Lightning steps a short window.

    A micro-step that failed (ready, not processed) is not counted here: it is not trained.
    """
    progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if progress is None or accumulate <= 1:
        return 0
    done = progress.current.processed  # within the epoch: Lightning's windows restart with each epoch
    if done == getattr(trainer, "num_training_batches", None):
        return 0
    return done % accumulate


def rewind_batch_progress(loops: dict[str, Any], micro_steps: int) -> None:
    """Set a checkpoint's training batch progress (``checkpoint["loops"]``) back by ``micro_steps``
    finished micro-steps, to the start of their window: the resumed run fetches, trains and counts
    them again. The counters become equal (no batch in flight), which Lightning restores as a
    checkpoint written at a batch's end."""
    if micro_steps <= 0:
        return
    progress = loops["fit_loop"]["epoch_loop.batch_progress"]
    for scope in ("current", "total"):
        counters = progress[scope]
        start = counters["processed"] - micro_steps
        for name in _COUNTERS:
            counters[name] = start
    progress["is_last_batch"] = False


__all__ = ["micro_steps_into_window", "rewind_batch_progress"]

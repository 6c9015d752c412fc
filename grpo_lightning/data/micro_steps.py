"""The training dataloader yields cheap micro-step descriptors, never rollouts.

Lightning fetches one batch ahead of training. Generating inside the iterator would sample the
next generation batch with the weights from *before* the current optimizer step (silently
off-policy), so the iterator only says which micro-step comes next; the datamodule generates
in ``on_after_batch_transfer``, right before ``training_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from grpo_lightning.utils.accumulation_window import micro_steps_into_window


# Not frozen (nor EvalRef): under ``*-true`` precision Lightning passes every batch through the
# precision plugin's ``convert_input``, which rebuilds a dataclass by setting each field on a copy.
@dataclass(unsafe_hash=True)
class MicroStepRef:
    """Which micro-step to train: a position in the fixed schedule of one run."""

    step: int  # global micro-step index since the run started
    epoch: int  # pass over the prompt dataset
    generation: int  # generation batch within the epoch
    iteration: int  # replay of that generation batch (0 .. num_iterations-1)
    micro_index: int  # micro-batch within the generation batch (0 .. steps_per_generation-1)


@dataclass(frozen=True)
class MicroStepSchedule:
    """Maps a global micro-step index to its position: generations × iterations × micro-batches."""

    generations_per_epoch: int
    steps_per_generation: int
    num_iterations: int

    @property
    def steps_per_epoch(self) -> int:
        return self.generations_per_epoch * self.steps_per_generation * self.num_iterations

    def ref(self, step: int) -> MicroStepRef:
        epoch, within_epoch = divmod(step, self.steps_per_epoch)
        generation, within_generation = divmod(within_epoch, self.steps_per_generation * self.num_iterations)
        iteration, micro_index = divmod(within_generation, self.steps_per_generation)
        return MicroStepRef(step, epoch, generation, iteration, micro_index)

    def window_start_ref(self, step: int, accumulate: int) -> MicroStepRef:
        """The first micro-step of the optimizer step that micro-step ``step`` belongs to."""
        return self.ref(window_start(step, self.steps_per_epoch, accumulate))


class MicroStepStream(IterableDataset):
    """Yields the rest of the current epoch's micro-steps, starting after the last one trained.

    ``start_step`` is read when iteration starts, so a resumed run continues where the checkpoint
    left off and each new epoch starts at its first micro-step.
    """

    def __init__(self, schedule: MicroStepSchedule, start_step: Callable[[], int]) -> None:
        self.schedule = schedule
        self.start_step = start_step

    def __iter__(self) -> Iterator[MicroStepRef]:
        first = self.start_step()
        end = (first // self.schedule.steps_per_epoch + 1) * self.schedule.steps_per_epoch
        for step in range(first, end):
            yield self.schedule.ref(step)

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch


def window_steps(step: int, steps_per_epoch: int, accumulate: int) -> int:
    """Micro-steps in the optimizer step that micro-step ``step`` belongs to. Lightning steps the
    optimizer at an epoch's end, so the last window of an epoch may be short: its per-step
    normalisers (the accumulation divisor, the global token count) must count only the micro-steps
    it has.

    >>> [window_steps(s, steps_per_epoch=5, accumulate=2) for s in range(7)]
    [2, 2, 2, 2, 1, 2, 2]
    """
    within = step % steps_per_epoch
    return min(accumulate, steps_per_epoch - (within - within % accumulate))


def window_start(step: int, steps_per_epoch: int, accumulate: int) -> int:
    """The first micro-step of the optimizer step that micro-step ``step`` belongs to (windows
    restart with each epoch, as in :func:`window_steps`).

    >>> [window_start(s, steps_per_epoch=5, accumulate=2) for s in range(7)]
    [0, 0, 2, 2, 4, 5, 5]
    """
    within = step % steps_per_epoch
    return step - within % accumulate


def resume_position(fetched: int, trainer: object) -> int:
    """The micro-step a checkpoint written now resumes at, of the ``fetched`` ones: after the last
    one trained, not counting a training step that is running now (a checkpoint written when it
    failed: Lightning's batch progress shows it ready, not processed), and back to the start of the
    open accumulation window, whose gradients a checkpoint does not hold (``utils/accumulation_window.py``)."""
    progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
    in_flight = (progress is not None and getattr(trainer, "training", False) and fetched > 0
                 and progress.current.ready > progress.current.processed)
    return fetched - int(in_flight) - micro_steps_into_window(trainer)


class DescriptorLoader(DataLoader):
    """The training loader of micro-step descriptors. It draws nothing from the global RNG (it has
    its own generator, where a plain DataLoader draws a seed from the global one at every epoch's
    iterator), and it is resumable: its position is ``position()`` (the datamodule's
    ``micro_steps_done``, restored with the datamodule's state), so Lightning's loader state hooks
    have nothing more to restore."""

    def __init__(self, stream: MicroStepStream, position: Callable[[], int]) -> None:
        super().__init__(stream, batch_size=None, num_workers=0, generator=torch.Generator())
        self._position = position

    def state_dict(self) -> dict[str, int]:
        return {"micro_steps_done": self._position()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Nothing to do: ``RolloutDataModule.load_state_dict`` restored the position."""

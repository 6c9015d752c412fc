"""What a checkpoint must hold for a resumed run to continue exactly as if it never stopped.

Layer L4 (data side). ``RolloutDataModule.state_dict`` stores, besides the prompt position:

* the **run plan** (dataset identity, batch arithmetic, world size, dynamic sampling): a resume
  under another plan would silently train on other prompts or another batch split, so it is
  refused by name;
* per rank, **every RNG stream** (torch CPU and CUDA, numpy, Python) and the **generation buffer**
  (the rollouts of a generation batch that spans several optimizer steps when ``num_iterations``
  or ``steps_per_generation`` replay it). Checkpoints are saved at optimizer-step ends, which can
  fall inside a generation batch; restoring its rollouts (instead of regenerating them) keeps the
  remaining micro-steps identical. One written inside an accumulation window resumes at the
  window's start (``utils/accumulation_window.py``) and replays the rollouts of every generation
  batch the window drew from.

The RNG snapshot is taken when the checkpoint is written (after the step's optimizer update) and
applied right before the next training generation, the first consumer in an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import fields
from typing import Any, Mapping, Sequence

import torch

from grpo_lightning.data.prompt_order import PromptOrder
from grpo_lightning.errors import ConfigError
from grpo_lightning.types import CompletionTable, RolloutBatch

log = logging.getLogger(__name__)

#: A training generation batch: ``(epoch, generation within the epoch)``.
GenerationKey = tuple[int, int]

#: Settings that fix which prompts each micro-step trains on; a resume must not change them.
PLAN_KEYS = (
    "dataset_rows", "dataset_digest", "num_generations", "generation_batch_size", "steps_per_generation",
    "per_device_train_batch_size", "num_iterations", "accumulate_grad_batches", "world_size", "shuffle_dataset",
    "dynamic_sampling",
)
#: What a plan key means when a checkpoint predates it: the setting's default, which that run had.
PLAN_DEFAULTS: dict[str, Any] = {"dynamic_sampling": None}


def dataset_digest(prompts: Sequence[Any], sample: int = 16) -> str:
    """A short hash of the prompt column (its size and up to ``sample`` rows spread over it):
    cheap on a million-row dataset, and it changes when the data or its order changes.

    >>> dataset_digest(["a", "b"]) == dataset_digest(["a", "b"]), dataset_digest(["a", "b"]) == dataset_digest(["b", "a"])
    (True, False)
    """
    n = len(prompts)
    picks = sorted({int(i * (n - 1) / max(sample - 1, 1)) for i in range(min(sample, n))})
    payload = json.dumps([n, [[i, prompts[i]] for i in picks]], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def check_same_plan(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` naming every plan setting that differs from the checkpoint's."""
    if not saved:
        return  # a checkpoint written before plans were recorded
    recorded = {**{k: v for k, v in PLAN_DEFAULTS.items() if k not in saved}, **saved}
    changed = {k: (recorded.get(k), current.get(k)) for k in PLAN_KEYS
               if k in recorded and recorded.get(k) != current.get(k)}
    if changed:
        listed = "; ".join(f"{k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in changed.items())
        raise ConfigError(
            f"This checkpoint was written by a run with another data plan ({listed}). Resuming would train on "
            "other prompts or another batch split than the run it continues. Resume with the original settings "
            "(dataset, data.*, trainer.accumulate_grad_batches, devices x num_nodes), or start a new run in another "
            "trainer.default_root_dir (from the checkpoint's weights: model.model=<exported model>)."
        )


def run_plan(dataset_prompts: Sequence[Any], num_generations: int, plan: Any, per_device_train_batch_size: int,
             num_iterations: int, accumulate_grad_batches: int, world_size: int, shuffle_dataset: bool,
             dynamic_sampling: Any = None) -> dict[str, Any]:
    """The settings of :data:`PLAN_KEYS` for a run (``plan``: its ``GenerationPlan``;
    ``dynamic_sampling``: its ``DynamicSampling`` or ``None``)."""
    return dict(
        dataset_rows=len(dataset_prompts), dataset_digest=dataset_digest(dataset_prompts),
        num_generations=num_generations, generation_batch_size=plan.generation_batch_size,
        steps_per_generation=plan.steps_per_generation, per_device_train_batch_size=per_device_train_batch_size,
        num_iterations=num_iterations, accumulate_grad_batches=accumulate_grad_batches, world_size=world_size,
        shuffle_dataset=shuffle_dataset, dynamic_sampling=None if dynamic_sampling is None else dynamic_sampling.plan(),
    )


def resumed_prompt_order(order: PromptOrder, saved_seed: int | None) -> PromptOrder:
    """The prompt order to continue with, when its seed came from the global seed: the
    checkpoint's, if the global seed changed since (the run's prompt order is kept)."""
    if saved_seed is None or saved_seed == order.seed:
        return order
    log.warning("Resuming with the checkpoint's data seed %d (the global seed is now %d).", saved_seed, order.seed)
    return PromptOrder(order.num_rows, order.prompts_per_generation, order.shuffle, saved_seed)


def rank_state(held: Sequence[tuple[GenerationKey, Sequence[RolloutBatch]]],
               rng: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's part of a checkpoint: its RNG streams (``rng``, a :func:`rng_snapshot`, in
    place of the live ones when given) and the generation batches it holds, oldest first."""
    return {"rng": rng if rng is not None else rng_snapshot(),
            "held": [[list(key), [batch_state(b) for b in batches]] for key, batches in held]}


def restore_rank_state(state: Mapping[str, Any], device: torch.device | str
                       ) -> list[tuple[GenerationKey, list[RolloutBatch]]]:
    """Apply a :func:`rank_state`: set the RNG streams, return the generation batches it held."""
    restore_rng(state["rng"])
    if "held" not in state:  # written before several generation batches could be held
        held = [] if state.get("buffer_key") is None else [(state["buffer_key"], state["buffer"])]
    else:
        held = state["held"]
    return [(tuple(key), [batch_from_state(b, device) for b in batches]) for key, batches in held]


def rng_snapshot() -> dict[str, Any]:
    """Every RNG stream of this process (torch, CUDA when present, numpy, Python), as tensors,
    numbers and tuples (loadable with ``weights_only=True``)."""
    import random

    import numpy as np

    name, keys, position, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: Mapping[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(states["torch"])
    name, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def batch_state(batch: RolloutBatch) -> dict[str, Any]:
    """A ``RolloutBatch`` as plain values (CPU tensors, numbers, strings, dicts): loadable with
    ``torch.load(weights_only=True)``."""
    out: dict[str, Any] = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        out[f.name] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    return out


def batch_from_state(state: Mapping[str, Any], device: torch.device | str) -> RolloutBatch:
    values = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return RolloutBatch(**values)


def table_state(table: CompletionTable | None) -> dict[str, Any] | None:
    """The completion table of the generation batch being replayed, for a checkpoint: a resume
    inside that batch still logs its completions (``CompletionLogger``). Only columns of plain
    values (text, numbers, chat messages) are kept, as ``torch.load(weights_only=True)`` reads
    them back; a column of other objects (a VLM's images) is left out."""
    if table is None:
        return None
    return {"step": table.step, "columns": {name: list(values) for name, values in table.columns.items()
                                            if all(_plain(v) for v in values)}}


def table_from_state(state: Mapping[str, Any] | None) -> CompletionTable | None:
    return None if state is None else CompletionTable(int(state["step"]), {k: list(v) for k, v in state["columns"].items()})


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


__all__ = [
    "GenerationKey", "PLAN_DEFAULTS", "PLAN_KEYS", "batch_from_state", "batch_state", "check_same_plan", "dataset_digest", "rank_state",
    "restore_rank_state", "restore_rng", "resumed_prompt_order", "rng_snapshot", "run_plan", "table_from_state",
    "table_state",
]

"""Tensors partitioned by DeepSpeed ZeRO-3, told apart by duck typing (no DeepSpeed import here).

Under ZeRO-3 every parameter built inside ``deepspeed.zero.Init`` (or handed to a stage-3 engine)
holds an empty placeholder on each rank plus DeepSpeed's bookkeeping attributes: ``ds_id``,
``ds_shape`` (the whole shape) and ``ds_status``. Both the module side (export, generation) and the
samplers (weight pushes into vLLM) need whole tensors; the helpers they share live here, in L0,
and import ``deepspeed`` only when a partitioned tensor is actually met.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

DEEPSPEED_EXTRA = "pip install 'grpo-lightning[deepspeed]'"


def is_zero3(tensor: object) -> bool:
    """Whether ``tensor`` is a ZeRO-3 managed parameter (whole or not at the moment)."""
    return hasattr(tensor, "ds_id") and hasattr(tensor, "ds_shape")


def zero3_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The ZeRO-3 managed parameters of ``model`` (empty off ZeRO-3)."""
    return [p for p in model.parameters() if is_zero3(p)]


def is_partitioned(tensor: object) -> bool:
    """Whether ``tensor`` is a ZeRO-3 parameter whose whole data is not on this rank right now
    (inside ``GatheredParameters`` or a module's forward it is ``AVAILABLE``)."""
    if not is_zero3(tensor):
        return False
    return getattr(getattr(tensor, "ds_status", None), "name", "") != "AVAILABLE"


def whole_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The whole shape: ``ds_shape`` for a ZeRO-3 parameter, the tensor's own shape otherwise."""
    return tuple(tensor.ds_shape) if is_zero3(tensor) else tuple(tensor.shape)


def import_deepspeed():  # noqa: ANN201 - the deepspeed module
    """``import deepspeed``, or an error naming the extra to install."""
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError(f"DeepSpeed is needed here but could not be imported ({err}): {DEEPSPEED_EXTRA}.") from err
    return deepspeed


@contextmanager
def gathered(params: Iterable[torch.nn.Parameter], *, modifier_rank: int | None = None) -> Iterator[None]:
    """Whole ZeRO-3 ``params`` inside the block; those already whole (an enclosing gather) are
    left alone, since DeepSpeed refuses nested gathers of the same parameter. Collective: every
    rank of the parameters' group must enter with the same parameters."""
    todo = [p for p in params if is_partitioned(p)]
    if not todo:
        yield
        return
    with import_deepspeed().zero.GatheredParameters(todo, modifier_rank=modifier_rank):
        yield


def whole_copy(param: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (a collective for a partitioned ZeRO-3 parameter:
    every rank must call it, in the same order); other tensors are returned detached, uncopied."""
    if not is_partitioned(param):
        return param.detach()
    with gathered([param]):
        return param.detach().clone()  # the gathered storage is freed when the block exits

"""Whole weights of a DeepSpeed ZeRO-3 policy: for generation, and for the exported model.

Under ZeRO-3 each rank holds a slice of every parameter; the engine's forward hooks gather each
module's parameters just before its forward and free them after. Two ways to generate follow
(``GRPODeepSpeedStrategy.ds3_gather_for_generation``, TRL's field of the same name):

* gather once (``True``): all of the policy's parameters are gathered for the whole generation and
  the engine's module hooks are suspended meanwhile (left on, they would free the gathered
  parameters after every module's forward and fetch them again at the next token);
* generate sharded (``False``): nothing is gathered up front; the hooks fetch each module's
  weights at every forward. Slow, but a policy too large for one GPU still generates.

The export gathers one parameter at a time, so no rank ever holds the whole model at once.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

import torch

from grpo_lightning.utils.zero3 import gathered, is_partitioned, zero3_parameters


def _parameter_offload(engine: Any) -> Any:
    """The object that owns a stage-3 engine's module hooks (``None`` before the optimizer exists)."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        return None
    return getattr(optimizer, "parameter_offload", optimizer)


@contextmanager
def module_hooks_suspended(engine: Any) -> Iterator[None]:
    """The engine's ZeRO-3 forward/backward module hooks removed inside the block, then
    registered again (DeepSpeed re-records its prefetch trace on the next forward)."""
    offload = _parameter_offload(engine)
    if offload is None or not hasattr(offload, "forward_hooks"):
        yield
        return
    for param in offload.module.parameters():
        active = getattr(param, "ds_active_sub_modules", None)
        if active is not None:
            active.clear()
    for hook in (*offload.forward_hooks, *offload.backward_hooks):
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        offload._register_deepspeed_module(offload.module)


@contextmanager
def _gathered_for_generation(model: torch.nn.Module, engine: Any) -> Iterator[None]:
    with gathered(zero3_parameters(model)):
        with module_hooks_suspended(engine) if engine is not None else nullcontext():
            yield


def zero3_generation_context(model: torch.nn.Module, engine: Any, gather: bool) -> ContextManager[None]:
    """What a sampler enters around generation with a ZeRO-3 ``model``: whole weights and no
    module hooks (``gather``), or nothing at all (the hooks fetch each module's weights)."""
    return _gathered_for_generation(model, engine) if gather else nullcontext()


def zero3_full_state_dict(model: torch.nn.Module, *, keep: bool) -> dict[str, torch.Tensor]:
    """The whole state dict of a ZeRO-3 ``model`` as CPU tensors, gathered one parameter at a
    time (a collective per partitioned parameter: every rank must call it). Only the ranks with
    ``keep`` store the tensors (the others return an empty dict); tied weights are gathered once
    and appear under each of their names, as in ``state_dict()``."""
    state: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor | None] = {}  # id(tensor) -> its CPU copy (None where not kept)
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in copies:
            with gathered([value]) if is_partitioned(value) else nullcontext():
                copies[id(value)] = value.detach().to("cpu", copy=True) if keep else None
        if keep:
            state[key] = copies[id(value)]
    return state

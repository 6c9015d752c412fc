"""Whole-weight operations on a policy that a strategy may have sharded.

Lightning's FSDP2 (``ModelParallelStrategy``), FSDP and DeepSpeed ZeRO-3 strategies leave each rank
with a shard of every parameter (and of every gradient). Three things need the whole tensors:
generation (and copies into an inference engine), the gradient norm, and the exported model. Each
has one function here that asks the layout what it is, so the module never special-cases a
strategy inline. On a single device or under DDP every function takes its plain path. (The
gradient norm lives in ``gradients.py``.)
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

import torch


def _fsdp2_modules(model: torch.nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _zero3_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters partitioned by DeepSpeed ZeRO-3 (they carry a ``ds_id``)."""
    return [p for p in model.parameters() if hasattr(p, "ds_id")]


def _fsdp1_root(model: torch.nn.Module) -> Any:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return None
    return next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)


@contextmanager
def _fsdp2_unsharded(modules: list[Any]) -> Iterator[None]:
    # Gather every group once and keep it gathered across forwards: generation runs a different
    # number of forwards on each rank, so per-forward all-gathers would deadlock (and be slow).
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(True, recurse=False)


def gathered_weights(model: torch.nn.Module, *, writeback: bool = False) -> ContextManager[None]:
    """Whole weights of ``model`` inside the block (a no-op when they are not sharded).

    ``writeback``: DeepSpeed/FSDP1 copy changes made inside the block back into the shards (used
    when the weights are modified, e.g. a reference-model update); generation leaves it off.
    """
    fsdp2 = _fsdp2_modules(model)
    if fsdp2:
        if writeback:
            raise NotImplementedError("Writing whole weights back into FSDP2 shards: use DTensor ops on the shards.")
        return _fsdp2_unsharded(fsdp2)
    zero3 = _zero3_parameters(model)
    if zero3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(zero3, modifier_rank=0 if writeback else None)
    root = _fsdp1_root(model)
    if root is not None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.summon_full_params(root, writeback=writeback, recurse=True)
    return nullcontext()


def full_state_dict(model: torch.nn.Module, strategy: Any = None) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict of ``model`` (CPU tensors where gathered).

    Collective under sharding: every rank must call it. Non-empty at least on global rank 0,
    which is the one that writes the export.
    """
    if _fsdp2_modules(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _zero3_parameters(model):
        with gathered_weights(model):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    root = _fsdp1_root(model)
    if root is not None:
        from torch.distributed.fsdp import (
            FullStateDictConfig,
            FullyShardedDataParallel,
            StateDictType,
        )

        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FullyShardedDataParallel.state_dict_type(root, StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()
    return model.state_dict()


def shard_fsdp2(model: torch.nn.Module, mesh: Any) -> None:
    """Apply FSDP2 ``fully_shard`` to each transformer block, then to the whole model.

    Blocks are the module classes a transformers model lists in ``_no_split_modules`` (its
    decoder layers); sharding them one by one lets each block's weights be gathered just for its
    forward and backward. A frozen model (the reference) is sharded the same way.
    """
    from torch.distributed.fsdp import fully_shard

    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} lists no transformer block classes (_no_split_modules): FSDP2 needs them "
            "to shard block by block. Use trainer.strategy=ddp, or a transformers model class that lists them."
        )
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

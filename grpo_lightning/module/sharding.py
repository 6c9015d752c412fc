"""Whole-weight operations on a policy that a strategy may have sharded.

Lightning's FSDP2 (``ModelParallelStrategy``), FSDP and DeepSpeed ZeRO-3 strategies leave each rank
with a shard of every parameter (and of every gradient). Three things need the whole tensors:
generation (and copies into an inference engine), the gradient norm, and the exported model. Each
has one function here that asks the layout what it is, so the module never special-cases a
strategy inline. On a single device or under DDP every function takes its plain path. (The
gradient norm lives in ``gradients.py``; ZeRO-3's gathers in ``deepspeed_zero3.py``.)

Lightning's ``FSDPStrategy`` (FSDP1) wraps the whole LightningModule in its root FSDP unit, so the
policy's own parameters (embeddings, head, and every layer that no auto-wrap policy split off) are
only reachable through that root: the functions take the ``strategy`` to find it.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from grpo_lightning.module.deepspeed_zero3 import zero3_full_state_dict, zero3_generation_context
from grpo_lightning.utils.zero3 import gathered, zero3_parameters


def _fsdp2_modules(model: torch.nn.Module) -> list[Any]:
    return [m for m in model.modules() if is_fsdp2_root(m)]


def is_fsdp2_root(model: torch.nn.Module) -> bool:
    """Whether ``model`` itself is an FSDP2 module (``fully_shard`` applied to it: the policy's
    root, or one of its blocks)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def call_as_forward(model: torch.nn.Module, compute: Callable[..., Any], *args: Any) -> Any:
    """``compute(*args)`` run as ``model``'s forward, through ``model.__call__`` and so its hooks.

    The optimized forward paths call the decoder and the LM head themselves, and a sharding
    strategy gathers a module's weights in hooks around the module's own call:

    * FSDP2: the root module's parameters (embeddings, final norm, LM head) are gathered by the
      root's forward hooks, which also register the backward that reduce-scatters their gradients;
      the root keeps them gathered from its forward through the backward. The paths run as the
      root's forward (the blocks gather their own in their calls).
    * DeepSpeed ZeRO-3: each module's hooks fetch its parameters for its forward, release them
      after, and fetch them again before its backward (hooks on the outputs) and release them after
      (hooks on the tensor inputs: pass them in ``args``). The chunked LM head runs as the head
      module's forward, so its weight is whole in both passes."""
    shadowed = model.__dict__.get("forward")
    model.forward = lambda *inputs, **kwargs: compute(*inputs)  # an instance attribute shadows the class's
    try:
        return model(*args)
    finally:
        if shadowed is None:
            del model.forward
        else:
            model.forward = shadowed


def _fsdp1_root(model: torch.nn.Module, strategy: Any = None) -> Any:
    """The FSDP1 unit that holds ``model``'s parameters: the strategy's root wrapper when it
    contains ``model`` (Lightning's ``FSDPStrategy``), else the outermost FSDP unit inside it."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return None
    root = getattr(strategy, "model", None)
    if isinstance(root, FullyShardedDataParallel) and any(m is model for m in root.modules()):
        return root
    return next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)


def _prefix_in(root: torch.nn.Module, model: torch.nn.Module) -> str:
    """``model``'s state-dict key prefix inside ``root`` (FSDP1 removes its wrapper names)."""
    name = next(n for n, m in root.named_modules() if m is model)
    name = name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
    return f"{name.strip('.')}." if name.strip(".") else ""


def is_zero3_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's DeepSpeed strategy at ZeRO stage 3."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3


def plain_forward_reason(strategy: Any) -> str | None:
    """Why the policy must run its own ``forward`` (the plain path) under ``strategy``, or None:
    FSDP1 keeps flat parameters the optimized paths do not read (not tested: FSDP1 needs a GPU).
    FSDP2 and ZeRO-3 run them through the modules' hooks (:func:`call_as_forward`)."""
    from lightning.pytorch.strategies import FSDPStrategy

    return "FSDP" if isinstance(strategy, FSDPStrategy) else None


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


def gathered_weights(model: torch.nn.Module, *, writeback: bool = False, strategy: Any = None) -> ContextManager[None]:
    """Whole weights of ``model`` inside the block (a no-op when they are not sharded).

    ``writeback``: DeepSpeed/FSDP1 copy changes made inside the block back into the shards (used
    when the weights are modified, e.g. a reference-model update); generation leaves it off.
    ``strategy``: the trainer's strategy, through which FSDP1's root unit is found. No forward
    may run inside a ZeRO-3 block: use :func:`generation_weights` for generation.
    """
    fsdp2 = _fsdp2_modules(model)
    if fsdp2:
        if writeback:
            raise NotImplementedError("Writing whole weights back into FSDP2 shards: use DTensor ops on the shards.")
        return _fsdp2_unsharded(fsdp2)
    zero3 = zero3_parameters(model)
    if zero3:
        return gathered(zero3, modifier_rank=0 if writeback else None)
    root = _fsdp1_root(model, strategy)
    if root is not None:
        return _fsdp1_summoned(root, writeback=writeback, recurse=True)
    return nullcontext()


_SUMMONED: set[int] = set()  # FSDP1 roots whose parameters are summoned right now


@contextmanager
def _fsdp1_summoned(root: torch.nn.Module, *, writeback: bool, recurse: bool) -> Iterator[None]:
    # Under Lightning's FSDPStrategy the policy and the reference share one root: a second
    # gather of the same root (a reference update reads the policy too) is already covered.
    if id(root) in _SUMMONED:
        yield
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    _SUMMONED.add(id(root))
    try:
        with FullyShardedDataParallel.summon_full_params(root, writeback=writeback, recurse=recurse):
            yield
    finally:
        _SUMMONED.discard(id(root))


def generation_weights(model: torch.nn.Module, strategy: Any = None) -> ContextManager[None]:
    """What a sampler enters around generation (``PolicyHandle.generation_context``): whole
    weights, except under ZeRO-3 with ``ds3_gather_for_generation: false`` on the strategy,
    where the model generates sharded (see ``deepspeed_zero3.py``)."""
    if zero3_parameters(model):
        engine = getattr(strategy, "model", None) if is_zero3_strategy(strategy) else None
        return zero3_generation_context(model, engine, gather=getattr(strategy, "ds3_gather_for_generation", True))
    root = None if _fsdp2_modules(model) else _fsdp1_root(model, strategy)
    if root is not None:
        # FSDP1 forbids forwards inside a summon of the units that run them: only the root's own
        # parameters (embeddings, head) are summoned, the wrapped blocks gather in their forward
        # (``generate`` keeps the ranks in step: synced_gpus), as TRL generates under FSDP1.
        return _fsdp1_summoned(root, writeback=False, recurse=False)
    return gathered_weights(model, strategy=strategy)


def full_state_dict(model: torch.nn.Module, strategy: Any = None) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict of ``model`` (CPU tensors where gathered).

    Collective under sharding: every rank must call it. Complete at least on global rank 0,
    which is the one that writes the export (FSDP1 and ZeRO-3 leave the other ranks' dicts
    empty rather than hold a copy of the whole model on every rank).
    """
    if _fsdp2_modules(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if zero3_parameters(model):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return zero3_full_state_dict(model, keep=rank == 0)
    root = _fsdp1_root(model, strategy)
    if root is not None:
        from torch.distributed.fsdp import (
            FullStateDictConfig,
            FullyShardedDataParallel,
            StateDictType,
        )

        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FullyShardedDataParallel.state_dict_type(root, StateDictType.FULL_STATE_DICT, config):
            state = root.state_dict()
        prefix = _prefix_in(root, model)
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return model.state_dict()


def block_classes(model: torch.nn.Module) -> set[type[torch.nn.Module]]:
    """The transformer block classes inside ``model``: those its transformers models list in
    ``_no_split_modules`` (their decoder layers)."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    return {type(m) for m in model.modules() if type(m).__name__ in names}


class TransformerBlockPolicy(ModuleWrapPolicy):
    """FSDP1 auto-wrap policy for Lightning's ``FSDPStrategy(auto_wrap_policy=...)``: one FSDP unit
    per transformer block (:func:`block_classes`) of the models inside the wrapped module, found
    when FSDP wraps it, so the same YAML serves every architecture; each block's weights are then
    gathered only for its own forward and backward. YAML: ``auto_wrap_policy: {class_path:
    grpo_lightning.module.sharding.TransformerBlockPolicy}``."""

    def __init__(self) -> None:
        super().__init__(set())  # the classes are found in the module being wrapped

    def _run_policy(self, root_module: torch.nn.Module, ignored_modules: set, root_kwargs: dict) -> dict:
        classes = block_classes(root_module)
        if not classes:
            raise ValueError(
                f"{type(root_module).__name__} holds no transformers model listing its block classes "
                "(_no_split_modules): set trainer.strategy.init_args.auto_wrap_policy to the block classes instead."
            )
        return ModuleWrapPolicy(classes)._run_policy(root_module, ignored_modules, root_kwargs)


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

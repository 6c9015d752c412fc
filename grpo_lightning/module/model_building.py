"""Building the policy and the reference inside ``GRPOModule.configure_model``.

Lightning calls ``configure_model`` inside the strategy's device, sharding and precision contexts;
everything here runs there, so what it builds can be sharded (FSDP2 on a device mesh, ZeRO-3 at
init) instead of being materialised whole on every rank first.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from grpo_lightning.module.model_loading import frozen, load_policy, zero_dropout
from grpo_lightning.module.sharding import shard_fsdp2
from grpo_lightning.utils.checkpointing import set_activation_checkpointing


@dataclass(frozen=True)
class ModelSettings:
    """How the policy is loaded and prepared for training (``GRPOModule``'s model knobs)."""

    model_init_kwargs: dict[str, Any] | None = None
    trust_remote_code: bool = False
    dtype: str = "float32"
    gradient_checkpointing: bool = True
    disable_dropout: bool = False

    def load(self, source: str | torch.nn.Module) -> torch.nn.Module:
        return load_policy(
            source, model_init_kwargs=self.model_init_kwargs, trust_remote_code=self.trust_remote_code, dtype=self.dtype
        )


@dataclass
class BuiltModels:
    policy: torch.nn.Module
    reference: torch.nn.Module | None


def build_models(
    source: str | torch.nn.Module, settings: ModelSettings, *, with_reference: bool, mesh: Any = None
) -> BuiltModels:
    """The trainable policy and, if asked, the frozen reference of its initial weights.

    The reference is a fresh load of a path (as TRL) or a deep copy of a model object (an object
    modified in memory is not what its path holds, spec §14.12). With an FSDP2 ``mesh`` both are
    sharded block by block.
    """
    policy = settings.load(source)
    if settings.disable_dropout:
        zero_dropout(policy)
    policy.train()  # from_pretrained returns eval mode; Lightning keeps submodule modes
    if settings.gradient_checkpointing:
        set_activation_checkpointing(policy, True)
    if getattr(policy, "config", None) is not None:
        policy.config.use_cache = False  # training forwards never reuse a KV cache
    reference = None
    if with_reference:
        reference = frozen(settings.load(source) if isinstance(source, str) else copy.deepcopy(policy))
    if mesh is not None:
        for model in (policy, reference):
            if model is not None:
                shard_fsdp2(model, mesh)
    return BuiltModels(policy, reference)


def data_parallel_mesh(device_mesh: Any) -> Any:
    """The mesh to shard over when Lightning's ``ModelParallelStrategy`` set one, else None."""
    if device_mesh is None:
        return None
    names = device_mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and device_mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            "ModelParallelStrategy(tensor_parallel_size > 1): tensor parallelism is not supported; set "
            "tensor_parallel_size=1 (FSDP2 over all devices)."
        )
    return device_mesh["data_parallel"] if "data_parallel" in names else device_mesh

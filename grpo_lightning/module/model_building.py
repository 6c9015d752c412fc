"""Building the policy and the reference inside ``GRPOModule.configure_model``.

Lightning calls ``configure_model`` inside the strategy's device, sharding and precision contexts;
everything here runs there, so what it builds can be sharded (FSDP2 on a device mesh, ZeRO-3 at
init) instead of being materialised whole on every rank first. With ``peft_config`` the policy is
wrapped with LoRA adapters and no reference copy is built: the reference is the policy with its
adapters disabled (:func:`~grpo_lightning.module.peft_models.reference_scope`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from grpo_lightning.module.fp32_head import cast_lm_head_to_fp32
from grpo_lightning.module.model_loading import frozen, load_policy, zero_dropout
from grpo_lightning.module.peft_models import prepare_quantized, with_adapters
from grpo_lightning.module.peft_settings import LoRASettings, QuantizationSettings
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
    peft_config: LoRASettings | None = None
    quantization_config: QuantizationSettings | None = None
    cast_lm_head_to_fp32: bool = False

    def load(self, source: str | torch.nn.Module, *, quantized: bool = True) -> torch.nn.Module:
        kwargs = dict(self.model_init_kwargs or {})
        if quantized and self.quantization_config is not None:
            kwargs["quantization_config"] = self.quantization_config.to_transformers()
        model = load_policy(source, model_init_kwargs=kwargs, trust_remote_code=self.trust_remote_code, dtype=self.dtype)
        return cast_lm_head_to_fp32(model) if self.cast_lm_head_to_fp32 else model


@dataclass
class BuiltModels:
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    #: A fresh, unquantized base model on CPU for the merged export of a PEFT policy loaded from a path.
    load_base: Callable[[], torch.nn.Module] | None = None


def build_models(
    source: str | torch.nn.Module, settings: ModelSettings, *, with_reference: bool, mesh: Any = None
) -> BuiltModels:
    """The trainable policy and, if asked, the frozen reference of its initial weights.

    The reference is a fresh load of a path (as TRL) or a deep copy of a model object (an object
    modified in memory is not what its path holds, spec §14.12). With an FSDP2 ``mesh`` both are
    sharded block by block. With ``settings.peft_config`` the policy gets LoRA adapters (after a
    quantized load, peft's k-bit preparation) and ``with_reference`` builds nothing. With
    ``settings.cast_lm_head_to_fp32`` every model loaded (policy, reference, PEFT export base) has
    a float32 head; a deep-copied reference keeps the policy's.
    """
    policy = settings.load(source)
    if settings.quantization_config is not None:
        policy = prepare_quantized(policy)
    policy.train()  # from_pretrained returns eval mode; Lightning keeps submodule modes
    if settings.gradient_checkpointing:
        set_activation_checkpointing(policy, True)
    if getattr(policy, "config", None) is not None:
        policy.config.use_cache = False  # training forwards never reuse a KV cache
    load_base = None
    if settings.peft_config is not None:
        policy = with_adapters(policy, settings.peft_config, gradient_checkpointing=settings.gradient_checkpointing)
        with_reference = False  # the reference is the policy with its adapters disabled
        if isinstance(source, str):
            load_base = lambda: settings.load(source, quantized=False)  # noqa: E731
    if settings.disable_dropout:
        zero_dropout(policy)  # after wrapping: the adapters' dropout too
    reference = None
    if with_reference:
        reference = frozen(settings.load(source) if isinstance(source, str) else copy.deepcopy(policy))
    if mesh is not None:
        for model in (policy, reference):
            if model is not None:
                shard_fsdp2(model, mesh)
    return BuiltModels(policy, reference, load_base)


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

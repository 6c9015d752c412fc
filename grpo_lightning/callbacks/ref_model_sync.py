"""``RefModelSync``: TR-DPO's soft update of the reference model (TRL's ``sync_ref_model``).

Every ``ref_model_sync_steps`` optimizer steps the reference moves towards the policy,
``ref ← α·policy + (1−α)·ref`` parameter by parameter (``α = ref_model_mixup_alpha``). Each mix is
computed in float64 and rounded once to the parameter's dtype (TRL mixes in the parameter's own
dtype: two roundings; the results differ by at most one unit in the last place in float32).

Where the weights live decides how they are mixed:

* one device / DDP: in place;
* FSDP2 (``ModelParallelStrategy``): policy and reference are sharded the same way, so every rank
  mixes its own local shards (no gather); a reference laid out differently gets the policy's
  parameter redistributed to its layout first;
* DeepSpeed ZeRO-3 and FSDP1: inside ``gathered_weights(..., writeback=True)``
  (``module/sharding.py``), which writes the mixed whole tensors back into the shards;
* LoRA (``model.peft_config``): the reference is the base model (adapters disabled), see
  :func:`mix_lora_into_base_`.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import lightning.pytorch as pl
import torch

from grpo_lightning.errors import ConfigError
from grpo_lightning.module.peft_settings import is_peft_model
from grpo_lightning.module.sharding import gathered_weights

log = logging.getLogger(__name__)

#: Elements mixed at a time: bounds the float64 temporaries (32 MiB) for huge parameters.
_CHUNK = 1 << 22
_SHARDED_STRATEGIES = ("ModelParallelStrategy", "FSDPStrategy", "DeepSpeedStrategy")


def _is_sharded_strategy(strategy: Any) -> bool:
    """FSDP2, FSDP1 or DeepSpeed, subclasses included (``GRPODeepSpeedStrategy``)."""
    return any(cls.__name__ in _SHARDED_STRATEGIES for cls in type(strategy).__mro__)


class RefModelSync(pl.Callback):
    """Mixes the policy into the reference model every ``ref_model_sync_steps`` optimizer steps
    (TR-DPO, https://huggingface.co/papers/2404.09656; TRL's ``sync_ref_model``).

    After optimizer step ``s`` with ``s % ref_model_sync_steps == 0``:
    ``ref ← ref_model_mixup_alpha · policy + (1 − ref_model_mixup_alpha) · ref`` for every
    parameter. Rollouts generated afterwards get their reference log-probs from the mixed model.
    Needs a reference (``beta != 0``). With ``model.peft_config`` the reference is the base model:
    ``α`` of the adapter's update is merged into the base weights and the adapter keeps ``1 − α``
    of it, so the policy is unchanged (``docs/callbacks.md``). The reference weights are part of
    the module's checkpoint; the callback's own state (the last step it mixed at) is in its
    state dict, so a resumed run mixes exactly as one that never stopped.

    Args:
        ref_model_mixup_alpha: ``α`` in ``[0, 1]``: the policy's share of the new reference
            (1 copies the policy, 0 leaves the reference as it is).
        ref_model_sync_steps: Mix every this many optimizer steps (``τ``, TRL default 512).
    """

    def __init__(self, ref_model_mixup_alpha: float = 0.6, ref_model_sync_steps: int = 512) -> None:
        if not 0.0 <= ref_model_mixup_alpha <= 1.0:
            raise ConfigError(f"RefModelSync.ref_model_mixup_alpha={ref_model_mixup_alpha}: use a value in [0, 1].")
        if ref_model_sync_steps < 1:
            raise ConfigError(f"RefModelSync.ref_model_sync_steps={ref_model_sync_steps}: use a positive number of "
                              "optimizer steps.")
        self.ref_model_mixup_alpha = float(ref_model_mixup_alpha)
        self.ref_model_sync_steps = int(ref_model_sync_steps)
        #: The optimizer step of the last mix (0: none yet) and how many mixes were made.
        self.last_synced_step = 0
        self.num_syncs = 0

    # ------------------------------------------------------------------ checks, before any weights load
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not getattr(pl_module, "needs_reference_logprobs", False):
            raise ConfigError(
                "RefModelSync mixes the policy into the reference model, but the loss has beta == 0 (no reference): "
                "set model.loss.init_args.beta to a non-zero value, or remove the RefModelSync callback."
            )
        settings = getattr(pl_module, "model_settings", None)
        if getattr(settings, "peft_config", None) is None:
            return
        if settings.quantization_config is not None:
            raise ConfigError(
                "RefModelSync with model.quantization_config: the reference is the quantized base model, which "
                "cannot take the mixed (unquantized) weights. Remove quantization_config or the callback."
            )
        if settings.peft_config.use_dora:
            raise ConfigError("RefModelSync with model.peft_config.use_dora: a DoRA update is not linear in its "
                              "parameters, so the base cannot take alpha of it exactly. Use plain LoRA.")
        if _is_sharded_strategy(trainer.strategy):
            raise ConfigError(f"RefModelSync with model.peft_config under {type(trainer.strategy).__name__}: mixing "
                              "into sharded LoRA base weights is not implemented; use DDP or one device.")

    # -------------------------------------------------------------------------- the mix
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Fires after every micro-batch; global_step moves only when the optimizer stepped.
        step = trainer.global_step
        if step == 0 or step % self.ref_model_sync_steps or step <= self.last_synced_step:
            return
        self.sync(pl_module, trainer.strategy)
        self.last_synced_step = step
        self.num_syncs += 1
        if trainer.is_global_zero:
            log.info("RefModelSync: reference <- %.3g * policy + %.3g * reference at step %d.",
                     self.ref_model_mixup_alpha, 1.0 - self.ref_model_mixup_alpha, step)

    def sync(self, pl_module: pl.LightningModule, strategy: Any = None) -> None:
        """One mix now (collective under sharding: every rank calls it). ``strategy``: the
        trainer's, through which FSDP1's root unit is gathered."""
        alpha, ref, policy = self.ref_model_mixup_alpha, pl_module.ref_policy, pl_module.policy
        if ref is None:
            if not is_peft_model(policy):
                raise RuntimeError("RefModelSync: the module has no reference model (ref_policy is None).")
            mix_lora_into_base_(policy, alpha)
        elif _is_fsdp2(policy) or _is_fsdp2(ref):
            for model in (policy, ref):  # registered parameters are the sharded ones only when resharded
                _reshard_fsdp2(model)
            mix_parameters_(_matched(ref, policy), alpha)
        else:
            with gathered_weights(ref, writeback=True, strategy=strategy), gathered_weights(policy, strategy=strategy):
                mix_parameters_(_matched(ref, policy), alpha)

    def state_dict(self) -> dict[str, Any]:
        return {"last_synced_step": self.last_synced_step, "num_syncs": self.num_syncs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_synced_step = int(state_dict["last_synced_step"])
        self.num_syncs = int(state_dict["num_syncs"])


# ----------------------------------------------------------------------------- tensor mixing
@torch.no_grad()
def mix_(target: torch.Tensor, source: torch.Tensor, alpha: float) -> None:
    """``target ← (1−α)·target + α·source`` in place, in float64, rounded once to ``target``'s dtype."""
    if target.shape != source.shape:
        raise ValueError(f"cannot mix a {tuple(source.shape)} tensor into a {tuple(target.shape)} one")
    if not (target.is_contiguous() and source.is_contiguous()):
        target.copy_(target.double() * (1.0 - alpha) + source.to(target.device).double() * alpha)
        return
    for t, s in zip(target.view(-1).split(_CHUNK), source.reshape(-1).split(_CHUNK)):
        t.copy_(t.double() * (1.0 - alpha) + s.to(t.device).double() * alpha)


def mix_parameters_(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], alpha: float) -> None:
    """Mix each ``(reference, policy)`` pair; FSDP2 DTensors shard by shard (see :func:`_local_pair`)."""
    for ref_param, policy_param in pairs:
        target, source = _local_pair(ref_param, policy_param)
        mix_(target, source, alpha)


def _local_pair(ref_param: torch.Tensor, policy_param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors to mix on this rank: the local shards when both are DTensors laid out alike."""
    dtensor = _dtensor_type()
    if dtensor is None or not (isinstance(ref_param, dtensor) or isinstance(policy_param, dtensor)):
        return ref_param, policy_param
    if not isinstance(ref_param, dtensor):  # a whole reference, a sharded policy: gather the policy's
        return ref_param, policy_param.full_tensor()
    if not isinstance(policy_param, dtensor):
        raise RuntimeError("RefModelSync: the reference is sharded (FSDP2) but the policy is not; shard both alike.")
    if (policy_param.device_mesh, policy_param.placements) != (ref_param.device_mesh, ref_param.placements):
        policy_param = policy_param.redistribute(ref_param.device_mesh, ref_param.placements)
    return ref_param.to_local(), policy_param.to_local()


def _matched(ref: torch.nn.Module, policy: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(reference, policy)`` parameter pairs by name (same architecture: same names and shapes)."""
    policy_params = dict(policy.named_parameters())
    ref_params = dict(ref.named_parameters())
    if ref_params.keys() != policy_params.keys():
        only = sorted(ref_params.keys() ^ policy_params.keys())[:5]
        raise RuntimeError(f"RefModelSync: the reference and the policy have different parameters (e.g. {only}).")
    return [(ref_params[name], policy_params[name]) for name in ref_params]


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def _fsdp2_modules(model: torch.nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _is_fsdp2(model: torch.nn.Module) -> bool:
    return bool(_fsdp2_modules(model))


def _reshard_fsdp2(model: torch.nn.Module) -> None:
    # A root FSDP2 module may keep its parameters unsharded after a no-grad forward; mixing those
    # would be lost at the next reshard. reshard() is a no-op for a module already sharded.
    for module in _fsdp2_modules(model):
        module.reshard()


# ------------------------------------------------------------------------------ LoRA reference
@torch.no_grad()
def mix_lora_into_base_(policy: torch.nn.Module, alpha: float) -> None:
    """TR-DPO on a LoRA policy whose reference is its base model (adapters disabled).

    With ``policy = W + ΔW`` (``ΔW = scaling · B A`` of the active adapters) and ``ref = W``, the
    new reference ``α·policy + (1−α)·ref = W + α·ΔW``. The base becomes ``W + α·ΔW`` and every
    ``B`` is scaled by ``1 − α`` (``ΔW`` is linear in ``B``), so the policy, ``W + α·ΔW + (1−α)·ΔW``,
    is unchanged. A module trained in full (``modules_to_save``) mixes its trained copy into the
    original module, which is what the reference uses. Each result is rounded once (float64 mix).
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    for module in policy.modules():
        if isinstance(module, LoraLayer):
            adapters = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]
            for name in adapters:
                if module.use_dora.get(name) or getattr(module, "lora_bias", {}).get(name):
                    raise NotImplementedError(f"RefModelSync: adapter {name!r} uses DoRA or a LoRA bias; only plain "
                                              "LoRA can be mixed into the base exactly.")
            if not adapters:
                continue
            base = module.get_base_layer().weight
            delta = sum(module.get_delta_weight(name).to(base.device).double() for name in adapters)  # before B moves
            base.copy_(base.double() + delta * alpha)
            for name in adapters:
                lora_b = module.lora_B[name].weight if name in module.lora_B else module.lora_embedding_B[name]
                lora_b.copy_(lora_b.double() * (1.0 - alpha))
        elif isinstance(module, ModulesToSaveWrapper):
            trained = module.modules_to_save[module.active_adapters[0]]
            mix_parameters_(_matched(module.original_module, trained), alpha)

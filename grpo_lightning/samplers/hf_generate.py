"""Default sampler: ``transformers`` ``model.generate`` on the live policy, in-process."""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from grpo_lightning.samplers.base import Sampler
from grpo_lightning.samplers.generation_checks import check_cache_implementation, check_hf_generation
from grpo_lightning.samplers.hf_common import build_generation_config, completion_rollout, generation_mode, image_inputs
from grpo_lightning.types import GenerationParams, PromptInput, Rollout
from grpo_lightning.utils.weight_casts import reused_weight_casts

__all__ = ["HFGenerateSampler", "generation_mode", "STATIC_CACHE_BUCKET", "static_cache_length"]

#: A static KV cache is sized in whole buckets of this many positions (see ``static_cache_length``).
STATIC_CACHE_BUCKET = 256


class HFGenerateSampler(Sampler):
    """Samples with ``transformers`` ``generate`` on the policy being trained (no weight copies).

    Prompts are left-padded into batches. Generation stops on any of the policy's end-of-sequence
    ids (``handle.eos_token_ids``: the tokenizer's EOS and the model generation config's, e.g. a
    chat model's end-of-turn id), and a completion is cut after the first of them (inclusive).
    Under a sharding strategy the weights are gathered once around the whole request
    (``handle.generation_context()``).

    Under ``*-mixed`` precision the whole request runs under the training precision context with
    autocast's weight-cast cache on (:func:`~grpo_lightning.utils.weight_casts.reused_weight_casts`):
    each trainable weight is cast to 16 bits once per request instead of once per decode step
    (Lightning's autocast disables that cache). Same tokens; a 16-bit copy of the trainable weights
    is held while generating.

    Args:
        cache_implementation: KV-cache implementation passed to ``GenerationConfig``
            (e.g. ``"static"``); ``None`` uses the model's default dynamic cache. A static cache
            (also one set in ``generation_kwargs``) is sized in buckets of 256 positions unless
            ``generation_kwargs`` give ``max_cache_len`` (one size per request, from its widest
            prompt, capped at the model's context), so that a compiled decode step
            (``disable_compile: false``) recompiles only when a request outgrows its bucket, not
            at every new prompt width.
        max_batch_rows: generate at most this many sequences per ``generate`` call, to bound
            memory; ``None`` generates the whole request at once.
        cache_weight_casts: keep the 16-bit casts of the weights for the whole request under
            ``*-mixed`` precision (above); ``False`` casts them at every decode step, as TRL does,
            saving that copy's memory (2 bytes per trainable parameter).
    """

    name = "hf_generate"
    #: Prompts with images (``model_inputs``: pixel values, image grids) are generated with them.
    supports_images = True

    def __init__(
        self, cache_implementation: str | None = None, max_batch_rows: int | None = None, cache_weight_casts: bool = True
    ):
        super().__init__()
        if max_batch_rows is not None and max_batch_rows < 1:
            raise ValueError(f"max_batch_rows={max_batch_rows}: use a positive number or None.")
        check_cache_implementation(cache_implementation)
        self.cache_implementation = cache_implementation
        self.max_batch_rows = max_batch_rows
        self.cache_weight_casts = cache_weight_casts

    def check_generation(self, params: GenerationParams) -> None:
        check_hf_generation(params, "data.sampler: hf_generate")

    def generation_config(self, params: GenerationParams) -> Any:
        return build_generation_config(self.handle, params, cache_implementation=self.cache_implementation)

    def generate(
        self, prompts: Sequence[PromptInput], num_generations: int, params: GenerationParams
    ) -> list[Rollout]:
        rows = [p for p in prompts for _ in range(num_generations)]  # image prompts keep their inputs
        step = self.max_batch_rows or len(rows)
        handle = self.handle
        # One cache size for every call of the request, from its widest prompt.
        config = static_cache_length(self.generation_config(params), max(map(len, rows), default=0),
                                     getattr(handle, "max_context_length", None))
        rollouts: list[Rollout] = []
        with handle.generation_context(), generation_mode(handle.policy), handle.precision_context(), \
                reused_weight_casts(handle.device, self.cache_weight_casts):
            for start in range(0, len(rows), step):
                rollouts.extend(self._generate_rows(rows[start : start + step], config))
        return rollouts

    def _generate_rows(self, rows: list[PromptInput], config: Any) -> list[Rollout]:
        handle = self.handle
        model, tokenizer, device = handle.policy, handle.tokenizer, handle.device
        width = max(len(r) for r in rows)
        pad = tokenizer.pad_token_id
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (R, Tp) left-padded
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids) :] = 1
        extra = image_inputs(rows, width)  # (R, ...) pixel inputs of image prompts, else {}
        sequences = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            **{k: v.to(device) for k, v in extra.items()},
        )
        completions = sequences[:, width:].tolist()  # (R, <=max_new_tokens)
        stop = set(handle.eos_token_ids)
        return [completion_rollout(list(prompt), ids, stop, handle.policy_version)
                for prompt, ids in zip(rows, completions)]


def static_cache_length(config: Any, prompt_width: int, context_limit: int | None = None) -> Any:
    """``config`` with ``max_cache_len`` set for a static cache: ``prompt_width + max_new_tokens``
    rounded up to whole :data:`STATIC_CACHE_BUCKET` s, but not past the model's ``context_limit``
    when the request itself fits in it. Without it ``generate`` sizes the cache to
    each call's own length, so every longer prompt width builds a new cache shape (and, with the
    compiled decode step, a new compilation). A dynamic cache, or a ``max_cache_len`` already set,
    leaves ``config`` as it is; otherwise a copy is returned."""
    from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

    if config.cache_implementation not in ALL_STATIC_CACHE_IMPLEMENTATIONS or config.max_cache_len is not None:
        return config
    needed = prompt_width + config.max_new_tokens
    sized = copy.deepcopy(config)
    bucketed = -(-needed // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET
    if context_limit is not None and needed <= context_limit < bucketed:
        bucketed = context_limit
    sized.max_cache_len = bucketed
    return sized

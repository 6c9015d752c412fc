"""The log-prob forward of rows with images (vision-language models).

Every pass (training, old, reference) calls the model on prompt + completion with the rows'
extra inputs (:class:`~grpo_lightning.types.RowInputs`: pixel values, image grids, token-type
ids), exactly as generation saw them. It is the plain padded path: the fast paths are off for such
batches, each with a log line the first time (explicit fallback):

* padding-free packing and prompt sharing: the vision tower's features are scattered into the
  image-token positions of each row and Qwen-VL's M-RoPE positions are computed from the padded
  rows, which a packed layout does not reproduce; prompt sharing would also have to key on the
  images, not the ids alone.
* the chunked LM head (``chunked_lm_head``) is kept for the architectures in
  :data:`CHUNKED_HEAD_MODEL_TYPES`: the model runs with ``output_hidden_states`` and its own head on
  one position, and the real completion positions' final hidden states go through the LM head in
  chunks (:func:`~grpo_lightning.algo.chunked_logprobs.chunked_head_logprobs`). Other models (and
  those with a final logit soft-cap) get the full logits of the completion positions
  (``logits_to_keep = T + 1``), with a log line.
* ``logprob_token_budget`` is honoured: rows are grouped by tokens and each group takes its own
  rows' inputs.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch

from grpo_lightning.algo.chunked_logprobs import chunked_head_logprobs
from grpo_lightning.algo.logprobs import token_logprobs_and_entropy
from grpo_lightning.algo.shared_prefix import budget_groups
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.module.fp32_head import is_fp32_head
from grpo_lightning.module.lm_head_calibration import resolve_chunk_tokens
from grpo_lightning.types import RowInputs
from grpo_lightning.utils.image_positions import computes_own_positions, core_model
from grpo_lightning.utils.model_config import text_config

log = logging.getLogger(__name__)
_logged: set[str] = set()
# ``config.model_type`` of vision-language models whose logits are ``lm_head(h)`` of the language
# model's final (post-norm) hidden state ``h``, with no scale or soft-capping (transformers 5.17-5.24;
# each is checked against the model's own logits in tests/vlm). A model whose text config sets
# ``final_logit_softcapping`` keeps the model's logits.
CHUNKED_HEAD_MODEL_TYPES: set[str] = {
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "gemma3", "llava_next",
}


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def multimodal_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    model_inputs: RowInputs,
    *,
    with_entropy: bool = True,
    entropy_requires_grad: bool = False,
    options: ForwardOptions = ForwardOptions(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``(B, T)`` log-probs (and entropies) of the completions of image rows.

    Args as :func:`~grpo_lightning.module.forward.completion_logprobs`, plus ``model_inputs``: the
    rows' extra inputs, one entry per row of ``prompt_ids``.
    """
    if len(model_inputs) != prompt_ids.shape[0]:
        raise ValueError(f"{len(model_inputs)} rows of image inputs for a batch of {prompt_ids.shape[0]} rows.")
    head = _chunkable_head(model) if options.chunked_lm_head else None
    if options.padding_free:
        _log_once("Rows with images: padding-free packing and prompt sharing are off for them; using the padded "
                  "forward with the pixel inputs.")
    if options.chunked_lm_head and head is None:
        why = ("its text config sets final_logit_softcapping" if _model_type(model) in CHUNKED_HEAD_MODEL_TYPES
               else "not in grpo_lightning.module.multimodal_forward.CHUNKED_HEAD_MODEL_TYPES")
        _log_once(f"Rows with images: chunked LM head off for model type {_model_type(model)!r} ({why}); using the "
                  "model's logits.")
    if options.logprob_token_budget is not None and not torch.is_grad_enabled():
        return _budget_pass(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                            model_inputs, with_entropy, options)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, Tp+T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    width = completion_ids.shape[1]
    kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    if "logits_to_keep" in inspect.signature(type(core_model(model)).forward).parameters:
        kwargs["logits_to_keep"] = width + 1  # the LM head on completion positions only
    if not computes_own_positions(model):
        kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    extra = {k: v.to(input_ids.device) for k, v in model_inputs.collate(prompt_ids.shape[1], width).items()}
    if head is not None:
        kwargs["logits_to_keep"] = 1  # the model's own head on one position; ours on the completion
        hidden = model(**kwargs, **extra, output_hidden_states=True).hidden_states[-1]  # (B, Tp+T, H)
        return _chunked_head(hidden[:, prompt_ids.shape[1] - 1 : -1], head, completion_ids, completion_mask,
                             temperature, with_entropy, entropy_requires_grad, options)
    logits = model(**kwargs, **extra).logits
    logits = logits[:, -(width + 1) : -1, :]  # (B, T, V): position t predicts completion token t
    return token_logprobs_and_entropy(logits, completion_ids, temperature, with_entropy=with_entropy,
                                      entropy_requires_grad=entropy_requires_grad)


def _model_type(model: torch.nn.Module) -> str | None:
    return getattr(getattr(core_model(model), "config", None), "model_type", None)


def _chunkable_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The LM head when ``model``'s logits are ``head(final hidden state)``, else ``None``."""
    if _model_type(model) not in CHUNKED_HEAD_MODEL_TYPES:
        return None
    config = core_model(model).config
    lm_config = text_config(config)
    if getattr(lm_config, "final_logit_softcapping", None) is not None:
        return None
    get_head = getattr(core_model(model), "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return head if isinstance(head, torch.nn.Module) else None


def _chunked_head(
    hidden: torch.Tensor, head: torch.nn.Module, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
    temperature: float, with_entropy: bool, entropy_requires_grad: bool, options: ForwardOptions,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(B, T)`` log-probs (entropies) from the ``(B, T, H)`` hidden states predicting the completion
    tokens: the real tokens' states through ``head`` in chunks (float32 matmul for an FP32 head)."""
    real = completion_mask.bool()  # (B, T)
    states = hidden[real]  # (M, H)
    fp32 = is_fp32_head(head)
    with torch.autocast(states.device.type, enabled=False) if fp32 else nullcontext():
        logps, entropies = chunked_head_logprobs(
            states.float() if fp32 else states, completion_ids[real], head, temperature,
            chunk_tokens=resolve_chunk_tokens(options.lm_head_chunk_tokens, head, states),
            with_entropy=with_entropy, entropy_requires_grad=entropy_requires_grad,
        )
    out = torch.zeros(completion_ids.shape, dtype=logps.dtype, device=logps.device).index_put((real,), logps)
    if entropies is not None:
        entropies = torch.zeros_like(out).index_put((real,), entropies)
    return out, entropies


def _budget_pass(
    model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
    completion_mask: torch.Tensor, temperature: float, model_inputs: RowInputs, with_entropy: bool,
    options: ForwardOptions,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No-grad log-probs in token-budget groups (padded layout), each with its rows' inputs."""
    groups = budget_groups(prompt_ids, prompt_mask, completion_mask, int(options.logprob_token_budget),
                           packed=False, share_prompts=False)
    logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    entropies = torch.zeros_like(logps) if with_entropy else None
    per_group = replace(options, logprob_token_budget=None)
    for rows in groups:
        index = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        group_logps, group_entropies = multimodal_logprobs(
            model, prompt_ids[index], prompt_mask[index], completion_ids[index], completion_mask[index], temperature,
            model_inputs.select(index), with_entropy=with_entropy, options=per_group,
        )
        logps[index] = group_logps.float()
        if entropies is not None and group_entropies is not None:
            entropies[index] = group_entropies.float()
    return logps, entropies

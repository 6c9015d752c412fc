"""The log-prob forward of rows with images (vision-language models).

Every pass (training, old, reference) calls the model on prompt + completion with the rows'
extra inputs (:class:`~grpo_lightning.types.RowInputs`: pixel values, image grids, token-type
ids), exactly as generation saw them. It is the plain padded path: the fast paths are off for such
batches, each with a log line the first time (explicit fallback):

* padding-free packing and prompt sharing: the vision tower's features are scattered into the
  image-token positions of each row and Qwen-VL's M-RoPE positions are computed from the padded
  rows, which a packed layout does not reproduce; prompt sharing would also have to key on the
  images, not the ids alone.
* the chunked LM head: the full-vocabulary logits of the completion positions are materialised
  (``logits_to_keep = T + 1``).
* ``logprob_token_budget`` is honoured: rows are grouped by tokens and each group takes its own
  rows' inputs.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from grpo_lightning.algo.logprobs import token_logprobs_and_entropy
from grpo_lightning.algo.shared_prefix import budget_groups
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.types import RowInputs

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def _core(model: torch.nn.Module) -> torch.nn.Module:
    core = getattr(model, "module", model)
    if type(core).__module__.split(".")[0] == "peft" and callable(getattr(core, "get_base_model", None)):
        core = core.get_base_model()
    return core


def computes_own_positions(model: torch.nn.Module) -> bool:
    """Whether the model derives its position ids from the images itself (Qwen-VL's M-RoPE,
    ``get_rope_index``): then none are passed; otherwise they follow the attention mask."""
    core = _core(model)
    return any(callable(getattr(m, "get_rope_index", None)) for m in (core, getattr(core, "model", None)) if m is not None)


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
    if options.padding_free or options.chunked_lm_head:
        _log_once("Rows with images: padding-free packing, prompt sharing and the chunked LM head are off for "
                  "them; using the plain padded forward with the pixel inputs.")
    if options.logprob_token_budget is not None and not torch.is_grad_enabled():
        return _budget_pass(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                            model_inputs, with_entropy, options)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, Tp+T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    width = completion_ids.shape[1]
    kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    if "logits_to_keep" in inspect.signature(type(_core(model)).forward).parameters:
        kwargs["logits_to_keep"] = width + 1  # the LM head on completion positions only
    if not computes_own_positions(model):
        kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    extra = model_inputs.collate(prompt_ids.shape[1], width)
    logits = model(**kwargs, **{k: v.to(input_ids.device) for k, v in extra.items()}).logits
    logits = logits[:, -(width + 1) : -1, :]  # (B, T, V): position t predicts completion token t
    return token_logprobs_and_entropy(logits, completion_ids, temperature, with_entropy=with_entropy,
                                      entropy_requires_grad=entropy_requires_grad)


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
    per_group = ForwardOptions.plain()
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

"""The policy forward pass over prompt + completion, returning completion-token log-probs."""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch

from grpo_lightning.algo.logprobs import token_logprobs_and_entropy


@lru_cache(maxsize=None)
def _accepts_logits_to_keep(forward_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(forward_cls.forward).parameters


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool = True,
    entropy_requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the completion tokens.

    Args:
        prompt_ids, prompt_mask: ``(B, Tp)`` left-padded prompts.
        completion_ids, completion_mask: ``(B, T)`` right-padded completions.
        temperature: logits are divided by it (the sampled distribution is the one trained).

    Returns:
        ``(logps (B, T), entropies (B, T) or None)``, fp32.

    Position ids are derived from the attention mask, so left padding does not shift positions:
    the same positions ``generate`` used (TRL passes none, which is equivalent only for RoPE).
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, Tp+T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    width = completion_ids.shape[1]
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    core = getattr(model, "module", model)  # DDP-wrapped models expose the real class as .module
    if _accepts_logits_to_keep(type(core)):
        kwargs["logits_to_keep"] = width + 1  # run the LM head on completion positions only
    logits = model(**kwargs).logits
    logits = logits[:, -(width + 1) : -1, :]  # (B, T, V): position t predicts completion token t
    return token_logprobs_and_entropy(
        logits,
        completion_ids,
        temperature,
        with_entropy=with_entropy,
        entropy_requires_grad=entropy_requires_grad,
    )

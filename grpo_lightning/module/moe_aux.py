"""The Mixture-of-Experts router auxiliary loss (``router_aux_loss_coef``, spec §3.12).

A MoE model's config has an ``output_router_logits`` attribute (TRL's test for "MoE"); with it set
in the forward call, transformers' ``*ForCausalLM`` returns ``aux_loss``, the load-balancing loss
of its routers over the batch's real tokens (its ``attention_mask``). The training forward asks for
it and the module adds ``coef · aux_loss / GA`` to the policy loss, logging ``aux_loss`` (before
the coefficient). ``router_aux_loss_coef=None`` takes the model config's value (TRL 1.16); set on a
dense model it is an error.

The log-probs come from the same places as :func:`~grpo_lightning.module.forward.completion_logprobs`:
with ``chunked_lm_head`` the model's own forward runs on the padded batch with
``logits_to_keep=1`` and ``output_hidden_states`` (its aux loss sees exactly the plain path's
tokens) and the LM head runs in chunks on the final hidden states. The padding-free layouts are
not used for this pass: packing drops rows without completion tokens and shares prompts, which
would change the tokens the load-balancing loss averages over.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from grpo_lightning.algo.logprobs import token_logprobs_and_entropy
from grpo_lightning.algo.packing import padded_layout
from grpo_lightning.module.model_parts import accepts_logits_to_keep, log_once, model_parts, transformers_model
from grpo_lightning.module.forward import head_logprobs
from grpo_lightning.module.forward_options import ForwardOptions


def _text_config(config: Any) -> Any:
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def is_moe_config(config: Any) -> bool:
    """TRL's test: the (text) config has a non-None ``output_router_logits`` attribute."""
    return config is not None and getattr(_text_config(config), "output_router_logits", None) is not None


def resolve_router_aux_loss_coef(config: Any, coef: float | None) -> float:
    """The coefficient in use: ``coef``, or the model config's ``router_aux_loss_coef`` when
    ``None`` (0 for a dense model); 0 disables the term.

    Raises:
        ValueError: ``coef`` is not a finite number, or is non-zero for a model that is not MoE.
    """
    moe = is_moe_config(config)
    if coef is None:
        return float(getattr(_text_config(config), "router_aux_loss_coef", 0.0) or 0.0) if moe else 0.0
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
        raise ValueError(f"model.router_aux_loss_coef={coef!r}: expected a finite number, or null for the model's value.")
    if coef != 0.0 and not moe:
        model_type = getattr(config, "model_type", type(config).__name__)
        raise ValueError(
            f"model.router_aux_loss_coef={coef} is set, but the model ({model_type}) is not a Mixture-of-Experts "
            "model (its config has no output_router_logits), so it has no router loss: remove the setting (null)."
        )
    return float(coef)


def completion_logprobs_and_router_aux(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    *,
    entropy_requires_grad: bool = False,
    options: ForwardOptions = ForwardOptions(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logps (B, T), entropies (B, T), aux_loss ())``: the training forward of a MoE policy.

    Log-probs and entropies as :func:`~grpo_lightning.module.forward.completion_logprobs` gives
    them (chunked LM head when ``options.chunked_lm_head``; padded, never packed); ``aux_loss``
    is the model's load-balancing loss of this batch, with grad.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, Tp+T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    parts = model_parts(model) if (options.chunked_lm_head or options.padding_free) else None
    accepts_keep = accepts_logits_to_keep(type(transformers_model(model)))
    if options.padding_free:
        log_once("Padding-free forward off for the training pass with router_aux_loss_coef: the model's "
                  "load-balancing loss averages over the padded batch's tokens; using the padded batch.")
    if parts is not None and not isinstance(parts, str) and accepts_keep and completion_mask.any():
        layout = padded_layout(prompt_ids, prompt_mask, completion_ids, completion_mask)
        out = model(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                    position_ids=layout.position_ids, use_cache=False, output_hidden_states=True,
                    output_router_logits=True, logits_to_keep=1)
        logps, entropies = head_logprobs(parts, out.hidden_states[-1], layout, completion_ids.shape, temperature,
                                         True, entropy_requires_grad, options)
        return logps, entropies, _aux_loss(out, model)
    if isinstance(parts, str):
        log_once(f"Optimized log-prob forward off: {parts}; using the plain forward.")
    width = completion_ids.shape[1]
    kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False, output_router_logits=True)
    if accepts_keep:
        kwargs["logits_to_keep"] = width + 1
    out = model(**kwargs)
    logits = out.logits[:, -(width + 1) : -1, :]  # (B, T, V)
    logps, entropies = token_logprobs_and_entropy(
        logits, completion_ids, temperature, with_entropy=True, entropy_requires_grad=entropy_requires_grad
    )
    return logps, entropies, _aux_loss(out, model)


def _aux_loss(out: Any, model: torch.nn.Module) -> torch.Tensor:
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        raise RuntimeError(
            f"{type(transformers_model(model)).__name__} returned no aux_loss with output_router_logits=True: "
            "set model.router_aux_loss_coef=0 to train it without the router loss."
        )
    return aux.float()

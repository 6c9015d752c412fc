"""``cast_lm_head_to_fp32``: the LM head's weight and matmul in float32, the rest of the model as is.

ScaleRL (and TRL's ``cast_lm_head_to_fp32``, spec §9) keep the output projection in float32 so the
log-probs of the trained policy are not rounded through a bf16 matmul. Here the head's class is
swapped for :class:`FP32LMHead`, an ``nn.Linear`` that

* computes ``hidden.float() @ Wᵀ + b`` in float32 with autocast off (``bf16-mixed`` would
  otherwise run the matmul in bf16), and
* stays float32 through dtype conversions of the whole model (Lightning's ``bf16-true`` precision
  casts the module to bf16 after ``configure_model``).

Its parameters keep their names, so checkpoints and ``save_pretrained`` are unchanged (the head
is saved in float32). The chunked LM-head forward reads :func:`is_fp32_head` and runs the head in
float32 as well. Tied input/output embeddings are refused: the head's weight is then the
embedding matrix, which the rest of the model must keep in its own dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_lightning.utils.model_config import text_config


class FP32LMHead(torch.nn.Linear):
    """An ``nn.Linear`` LM head that computes in float32 and keeps float32 parameters.

    ``forward`` stays ``nn.Linear.forward`` (the chunked head path recognises a plain linear
    head by it); the float32 compute is in ``__call__``, around hooks and forward.
    """

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return super().__call__(hidden.float(), *args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> "FP32LMHead":
        super()._apply(fn, recurse)
        for param in self._parameters.values():
            if param is not None and param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
                if param.grad is not None:
                    param.grad.data = param.grad.data.float()
        return self


def is_fp32_head(head: Any) -> bool:
    """Whether ``head`` was cast by :func:`cast_lm_head_to_fp32` (or is another FP32LMHead)."""
    return isinstance(head, FP32LMHead)


def has_tied_head(model: torch.nn.Module) -> bool:
    """Whether ``model``'s output embedding shares its weight with the input embedding."""
    get_out, get_in = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    head = get_out() if callable(get_out) else None
    embed = get_in() if callable(get_in) else None
    weight = getattr(head, "weight", None)
    return weight is not None and weight is getattr(embed, "weight", None)


def tied_embeddings_error(where: str) -> ValueError:
    return ValueError(
        f"model.cast_lm_head_to_fp32=true needs separate input and output embeddings, but {where} ties them "
        "(tie_word_embeddings): the head's weight is the embedding matrix. Set model.cast_lm_head_to_fp32=false, "
        "or use a model with untied embeddings."
    )


def cast_lm_head_to_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """Swap ``model``'s LM head (an ``nn.Linear``) for :class:`FP32LMHead`, in place; returns ``model``.

    >>> from grpo_lightning.utils.tiny_models import build_tiny_causal_lm
    >>> model = cast_lm_head_to_fp32(build_tiny_causal_lm(40).to(torch.bfloat16))
    >>> model.lm_head.weight.dtype, model.model.embed_tokens.weight.dtype
    (torch.float32, torch.bfloat16)
    >>> model.to(torch.bfloat16).lm_head.weight.dtype
    torch.float32
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if has_tied_head(model):
        raise tied_embeddings_error(type(model).__name__)
    if type(head) is not torch.nn.Linear and not is_fp32_head(head):
        raise ValueError(
            f"model.cast_lm_head_to_fp32=true: the LM head of {type(model).__name__} is a {type(head).__name__}, "
            "not a plain torch.nn.Linear (an adapter on lm_head, say), so it cannot be cast. Set "
            "model.cast_lm_head_to_fp32=false, or keep lm_head out of peft_config's target_modules/modules_to_save."
        )
    head.__class__ = FP32LMHead
    head.float()
    return model


def check_fp32_head_setting(config: Any, peft_target_modules: list[str], modules_to_save: list[str]) -> None:
    """Refuse ``cast_lm_head_to_fp32`` with tied embeddings (from the model config) or a PEFT
    adapter on ``lm_head`` (TRL: the same), before any weights load."""
    tied = getattr(config, "tie_word_embeddings", None)
    lm_config = text_config(config)
    tied = tied if tied is not None else getattr(lm_config, "tie_word_embeddings", False)
    if tied:
        raise tied_embeddings_error(f"the model config ({getattr(config, 'model_type', '?')})")
    if "lm_head" in (*peft_target_modules, *modules_to_save):
        raise ValueError(
            "model.cast_lm_head_to_fp32=true with an adapter on lm_head (model.peft_config target_modules or "
            "modules_to_save) is not supported: remove lm_head there, or set model.cast_lm_head_to_fp32=false."
        )

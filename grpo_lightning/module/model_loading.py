"""Loading the policy, its tokenizer and the frozen reference model."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_policy(
    model: "str | torch.nn.Module",
    *,
    model_init_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    dtype: str = "float32",
) -> torch.nn.Module:
    """A causal LM from a local path / hub id, or the given model object unchanged.

    ``dtype`` defaults to float32 (TRL's default for string-loaded models: fp32 master weights,
    mixed precision comes from ``trainer.precision``).
    """
    if isinstance(model, torch.nn.Module):
        if model_init_kwargs:
            log.warning("model_init_kwargs are ignored when model is an instantiated model.")
        return model
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype={dtype!r}: use one of {sorted(_DTYPES)}.")
    kwargs = {"dtype": _DTYPES[dtype], "trust_remote_code": trust_remote_code}
    kwargs.update(model_init_kwargs or {})
    return AutoModelForCausalLM.from_pretrained(model, **kwargs)


def load_tokenizer(source: "str | Any", *, trust_remote_code: bool = False) -> Any:
    """The tokenizer at ``source`` (a path/id, or a tokenizer object), made ready for batching.

    A tokenizer without a pad token gets its EOS token as pad (as TRL does); one with neither is
    rejected with a clear message, since padding and truncation detection need them.
    """
    if isinstance(source, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    else:
        tokenizer = source
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"The tokenizer of {getattr(tokenizer, 'name_or_path', source)!r} has no EOS token, so "
            "completions could never end. Set tokenizer.eos_token (e.g. save a tokenizer with "
            "eos_token defined) or pass model.tokenizer pointing to one that has it."
        )
    if tokenizer.pad_token_id is None:
        log.info("Tokenizer has no pad token: using its EOS token %r as pad.", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def frozen_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """The reference model: a frozen copy of the *initial* policy weights, in eval mode.

    TRL re-loads the reference from the policy's path, so a policy object modified in memory is
    not what the KL is measured against (spec §14.12); copying the object avoids that.
    """
    reference = copy.deepcopy(policy)
    reference.requires_grad_(False)
    return reference.eval()


def zero_dropout(model: torch.nn.Module) -> None:
    """Set ``p=0`` on every ``nn.Dropout`` module (TRL's ``disable_dropout``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0

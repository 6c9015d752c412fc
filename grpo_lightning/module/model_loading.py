"""Loading the policy, its tokenizer and the frozen reference model."""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol, runtime_checkable

import torch

from grpo_lightning.errors import ConfigError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
#: Files of which a tokenizer folder holds at least one (besides ``*.model`` / ``*.tiktoken`` vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tekken.json")


@runtime_checkable
class CausalLM(Protocol):
    """An instantiated causal LM: a ``transformers`` ``PreTrainedModel`` (or a PEFT model around one).

    The type of ``GRPOModule(model=...)`` besides a path: a protocol rather than ``torch.nn.Module``,
    whose hundreds of subclasses the CLI would list in ``--help`` (YAML gives a path or hub id).
    """

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...

    def save_pretrained(self, save_directory: str, *args: Any, **kwargs: Any) -> Any: ...


def check_model_sources(model: "str | Any", tokenizer: str | None = None) -> None:
    """Cheap checks of ``model.model`` and ``model.tokenizer`` before any weights load.

    A path must exist (a mistyped one would otherwise reach the hub and fail as a bad repo id);
    a string that is not a local folder must look like a hub id (``org/name``); the folder the
    tokenizer comes from must hold tokenizer files. Raises :class:`ConfigError` naming the setting.
    """
    if isinstance(model, str):
        _check_source("model.model", model)
    if isinstance(tokenizer, str):  # else a tokenizer or processor object
        _check_source("model.tokenizer", tokenizer)
        if os.path.isdir(os.path.expanduser(tokenizer)) and not has_tokenizer_files(os.path.expanduser(tokenizer)):
            raise ConfigError(
                f"model.tokenizer={tokenizer!r} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
                "point it to a folder saved with tokenizer.save_pretrained, or to a hub id."
            )
    elif tokenizer is None and isinstance(model, str) and os.path.isdir(os.path.expanduser(model)):
        if not has_tokenizer_files(os.path.expanduser(model)):
            raise ConfigError(
                f"model.model={model!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): set "
                "model.tokenizer to the folder or hub id of its tokenizer, or save the tokenizer into the model folder."
            )


def has_tokenizer_files(folder: str) -> bool:
    """Whether ``folder`` holds a tokenizer that ``AutoTokenizer.from_pretrained`` can read."""
    names = os.listdir(folder)
    return any(n in TOKENIZER_FILES or n.endswith((".model", ".tiktoken")) for n in names)


def looks_like_hub_id(source: str) -> bool:
    """``name`` or ``org/name`` as the Hugging Face hub spells repository ids (no local-path syntax).

    >>> [looks_like_hub_id(s) for s in ("Qwen/Qwen2.5-0.5B", "gpt2", "./model", "runs/a/final_model", "~/m")]
    [True, True, False, False, False]
    """
    if source.startswith((".", "/", "~")) or "\\" in source or source.count("/") > 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def _check_source(setting: str, source: str) -> None:
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise ConfigError(f"{setting}={source!r} is a file: give the folder that holds it (saved with save_pretrained).")
    parent = source.split("/", 1)[0]
    if not looks_like_hub_id(source) or ("/" in source and os.path.isdir(parent)):  # `runs/x`: a local typo
        raise ConfigError(
            f"{setting}={source!r}: no such folder (a relative path starts at the working directory "
            f"{os.getcwd()}), and it is not a hub id such as 'org/name'. Check the path."
        )


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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype={dtype!r}: use one of {sorted(_DTYPES)}.")
    kwargs = {"dtype": _DTYPES[dtype], "trust_remote_code": trust_remote_code}
    kwargs.update(model_init_kwargs or {})
    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    # a vision-language model (Qwen-VL, SmolVLM, ...) or a causal LM
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    try:
        return auto.from_pretrained(model, **kwargs)
    except (TypeError, ValueError) as error:
        if not model_init_kwargs:
            raise
        # an unknown argument reaches the model's __init__ (TypeError), a bad value transformers' checks
        user = {k: v for k, v in model_init_kwargs.items() if k != "quantization_config"}
        settings = [f"model.model_init_kwargs={user}"] if user else []
        if "quantization_config" in model_init_kwargs:
            settings.append("model.quantization_config")
        raise ValueError(
            f"{' or '.join(settings)}: {auto.__name__}.from_pretrained({model!r}) failed with them: {error}. "
            "Check their names and values (e.g. attn_implementation: sdpa, eager)."
        ) from error


def tokenizer_source(model: "str | Any", tokenizer: str | None) -> "str | Any":
    """Where the tokenizer loads from: ``model.tokenizer``, else the model's path or ``name_or_path``."""
    source = tokenizer or (model if isinstance(model, str) else getattr(model, "name_or_path", None))
    if not source:
        raise ValueError("model.tokenizer is required when model is an instantiated model without a "
                         "name_or_path: give the tokenizer's path.")
    return source


def load_tokenizer(source: "str | Any", *, trust_remote_code: bool = False) -> Any:
    """The tokenizer at ``source`` (a path/id, or a tokenizer object), made ready for batching.

    A tokenizer without a pad token gets its EOS token as pad (as TRL does); one with neither is
    rejected with a clear message, since padding and truncation detection need them.
    """
    if isinstance(source, str) and is_processor_folder(source):
        from transformers import AutoProcessor

        source = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    if isinstance(source, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    elif getattr(source, "image_processor", None) is not None and getattr(source, "tokenizer", None) is not None:
        tokenizer = source.tokenizer  # a multimodal processor: its tokenizer, the processor as .processor
        tokenizer.processor = source  # read by grpo_lightning.data.multimodal.processor_of
        if getattr(tokenizer, "chat_template", None) is None:  # text rows and length checks use the tokenizer's
            tokenizer.chat_template = getattr(source, "chat_template", None)
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


def is_processor_folder(source: str) -> bool:
    """Whether a local folder holds a multimodal processor (``preprocessor_config.json`` or
    ``processor_config.json``): then it loads with ``AutoProcessor``."""
    path = os.path.expanduser(source)
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, n)) for n in ("preprocessor_config.json", "processor_config.json")
    )


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` frozen as a reference: no gradients, eval mode (no dropout)."""
    model.requires_grad_(False)
    return model.eval()


def zero_dropout(model: torch.nn.Module) -> None:
    """Set ``p=0`` on every ``nn.Dropout`` module (TRL's ``disable_dropout``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0

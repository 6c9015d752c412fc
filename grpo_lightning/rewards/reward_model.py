"""Sequence-classification reward models, called like reward functions (spec §5.1, §5.2).

Layer L1: torch and transformers (imported lazily), no lightning.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch


class RewardCallCancelled(RuntimeError):
    """A reward model call stopped early because it had timed out (its result was discarded)."""


class RewardModel:
    """A sequence-classification model (``num_labels=1``) that scores ``prompt + completion``.

    Called with TRL's reward-function convention, so the reward runner treats it like any other
    sync reward function; its metric name (``rewards/<name>/mean``) is the basename of the model
    path, as in TRL. Scoring follows TRL exactly: conversational prompts are rendered with
    ``apply_chat_template(prompt + completion messages)``, plain ones are the string
    ``prompt + completion``; texts are tokenized with ``padding=True, padding_side="right",
    add_special_tokens=False`` and the reward is ``logits[:, 0]`` (the classifier pools the last
    non-pad token), under ``torch.inference_mode()`` with the model in eval mode.

    With a time limit (``data.reward_timeout_s``) the model scores in a worker thread; a call that
    times out is told so through :meth:`cancel_reward_call` and stops before its next
    ``batch_size`` chunk (a forward pass already running cannot be interrupted, so with
    ``batch_size=None`` the whole late forward still runs, on the same device as training).

    The model stays where it is until :meth:`to` moves it (the datamodule moves every reward model
    to the training device through ``RewardRunner.to``); inputs follow the model's device.

    Args:
        model: A local folder or Hub id, loaded with
            ``AutoModelForSequenceClassification.from_pretrained(model, num_labels=1,
            **model_init_kwargs)`` (transformers' default dtype, like TRL), or an already built
            model (``PreTrainedModel`` or any ``nn.Module`` returning ``.logits``).
        processing_class: The reward model's tokenizer: a path/Hub id or a tokenizer object.
            Default: the tokenizer saved with the model (``model``'s path, or the model object's
            ``config._name_or_path``). Without a pad token, the EOS token is used for padding; the
            model's ``config.pad_token_id`` is set to the tokenizer's pad id either way.
        batch_size: Texts per forward pass; ``None`` scores all rows of a call at once (TRL).
        model_init_kwargs: Extra ``from_pretrained`` arguments when ``model`` is a path (e.g.
            ``{"dtype": "bfloat16", "revision": "main"}``). The tokenizer loaded with the model
            gets its Hub arguments (``revision``, ``cache_dir``, ``token``, ``local_files_only``).
        trust_remote_code: Allow custom modelling/tokenizer code from the model folder or Hub
            (for the model and for a tokenizer loaded by path).
        chat_template_kwargs: Extra ``apply_chat_template`` arguments for conversational prompts;
            ``None`` takes the run's ``chat_template_kwargs`` (set by the reward runner).
        name: Metric name; default: the path's basename, else the model's ``config._name_or_path``
            basename, else the model's class name.

    Example:
        >>> from transformers import LlamaConfig, LlamaForSequenceClassification
        >>> from grpo_lightning.utils.tiny_models import build_char_tokenizer
        >>> tok = build_char_tokenizer()
        >>> net = LlamaForSequenceClassification(LlamaConfig(
        ...     vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0))
        >>> rm = RewardModel(net, tok, batch_size=2)
        >>> rm.name
        'LlamaForSequenceClassification'
        >>> scores = rm(prompts=["1+1=", "2+2="], completions=["2", "5"])
        >>> len(scores), all(isinstance(s, float) for s in scores)
        (2, True)
    """

    def __init__(
        self,
        model: str | torch.nn.Module,
        processing_class: str | Any | None = None,
        *,
        batch_size: int | None = None,
        model_init_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"RewardModel batch_size={batch_size!r}: give a positive integer or None.")
        self.batch_size = batch_size
        self.chat_template_kwargs = chat_template_kwargs
        self.model = _load_model(model, model_init_kwargs, trust_remote_code)
        self.model.eval()
        self.tokenizer = _load_tokenizer(self.model, model, processing_class, trust_remote_code, model_init_kwargs)
        _set_pad_token(self.model, self.tokenizer)
        self.name = name or _model_name(model, self.model)
        self.__name__ = self.name  # what callable_name() reads for the metric name
        self._cancelled = False  # set by cancel_reward_call(), read between chunks

    # ------------------------------------------------------------------ device
    @property
    def device(self) -> torch.device:
        """The device of the model's first parameter (CPU for a parameter-less model)."""
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def to(self, device: torch.device | str) -> "RewardModel":
        """Move the model to ``device`` (in place) and return ``self``.

        Args:
            device: Target device, e.g. the training device ``cuda:0``.

        Returns:
            This reward model.
        """
        self.model.to(device)
        return self

    # ------------------------------------------------------------------ scoring
    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The texts the classifier reads, one per completion (spec §5.2).

        Args:
            prompts: Strings, or lists of chat messages (conversational).
            completions: Strings, or lists of assistant (and tool) messages.

        Returns:
            ``apply_chat_template(prompt + completion)`` texts for conversational prompts
            (decided on the first prompt, like TRL), else ``prompt + completion``.
        """
        if len(prompts) != len(completions):
            raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions.")
        if not prompts:
            return []
        if _is_conversational(prompts[0]):
            kwargs = self.chat_template_kwargs or {}
            return [
                self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False, **kwargs)
                for p, c in zip(prompts, completions)
            ]
        return [p + c for p, c in zip(prompts, completions)]

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """Rewards of ready-made texts: ``logits[:, 0]`` of right-padded batches.

        Args:
            texts: The full texts (prompt and completion) to score.

        Returns:
            One float per text.

        Raises:
            RewardCallCancelled: When :meth:`cancel_reward_call` was called during the call.
        """
        self._cancelled = False
        return self._score_chunks(texts)

    def cancel_reward_call(self) -> None:
        """Stop the running call before its next chunk (the reward runner calls this when the
        call ran past ``data.reward_timeout_s``; its result is discarded anyway)."""
        self._cancelled = True

    def _score_chunks(self, texts: Sequence[str]) -> list[float]:
        self.model.eval()  # cheap, and guards against a caller that switched to train mode
        step = self.batch_size or max(len(texts), 1)
        device = self.device
        rewards: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), step):
                if self._cancelled:
                    raise RewardCallCancelled(f"reward model '{self.name}' stopped after {start} of {len(texts)} texts")
                chunk = list(texts[start : start + step])
                inputs = self.tokenizer(
                    text=chunk, return_tensors="pt", padding=True, padding_side="right",
                    add_special_tokens=False,
                )  # fmt: skip
                inputs = {k: v.to(device) for k, v in inputs.items()}
                logits = self.model(**inputs).logits  # (b, num_labels)
                rewards.extend(logits[:, 0].float().cpu().tolist())
        return rewards

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float]:
        """Score completions (TRL's reward-function convention; other keywords are ignored).

        Args:
            prompts: One prompt per completion (strings or message lists).
            completions: The completions (strings or message lists).
            **kwargs: ``completion_ids``, dataset columns, trainer state: unused.

        Returns:
            One reward per completion.
        """
        self._cancelled = False
        return self._score_chunks(self.texts(prompts, completions))

    def __repr__(self) -> str:
        return f"RewardModel(name={self.name!r}, model={type(self.model).__name__}, device={self.device})"


def _is_conversational(prompt: Any) -> bool:
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and isinstance(prompt[0], dict)
        and "role" in prompt[0]
    )


def _load_model(
    model: Any, init_kwargs: dict[str, Any] | None, trust_remote_code: bool
) -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        if init_kwargs:
            raise ValueError(
                "RewardModel: model_init_kwargs only apply when the model is given as a path."
            )
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"RewardModel: model must be a path/Hub id or an nn.Module, not {type(model).__name__}."
        )
    path = os.path.expanduser(str(model))
    # A Hub id is "org/name"; anything else with a path shape must be an existing folder.
    looks_local = (
        path.startswith(("/", ".", "\\")) or path.count("/") > 1 or (os.sep != "/" and os.sep in path)
    )
    if looks_local and not os.path.isdir(path):
        raise ValueError(
            f"reward model folder '{model}' does not exist: give a folder saved with "
            "save_pretrained, or a Hub id 'org/name' (data.reward_funcs)."
        )
    from transformers import AutoModelForSequenceClassification

    kwargs = dict(init_kwargs or {})
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    kwargs.pop("num_labels", None)
    try:
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
    except Exception as err:
        if hasattr(err, "add_note"):
            err.add_note(
                f"(while loading reward model '{model}' from data.reward_funcs: it must be a "
                "sequence-classification model folder or Hub id)"
            )
        raise


# ``from_pretrained`` arguments of a model that also say where its tokenizer comes from.
_TOKENIZER_HUB_KWARGS = ("cache_dir", "token", "local_files_only")


def _load_tokenizer(
    model: torch.nn.Module,
    source: Any,
    processing_class: Any,
    trust_remote_code: bool,
    init_kwargs: dict[str, Any] | None = None,
) -> Any:
    if processing_class is not None and not isinstance(processing_class, (str, os.PathLike)):
        return processing_class
    from transformers import AutoTokenizer

    init_kwargs = init_kwargs or {}
    kwargs = {k: init_kwargs[k] for k in _TOKENIZER_HUB_KWARGS if k in init_kwargs}
    path = processing_class
    if path is None:
        is_path = isinstance(source, (str, os.PathLike))
        path = os.path.expanduser(str(source)) if is_path else _config_name(model)
        if is_path and "revision" in init_kwargs:  # the model's revision holds its tokenizer (TRL)
            kwargs["revision"] = init_kwargs["revision"]
    if not path:
        raise ValueError(
            f"reward model {type(model).__name__} has no tokenizer: it was given as an object "
            "without config._name_or_path. Pass its tokenizer (data.reward_processing_classes, "
            "or RewardModel(processing_class=...))."
        )
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, **kwargs)


def _set_pad_token(model: torch.nn.Module, tokenizer: Any) -> None:
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                "the reward model's tokenizer has neither a pad nor an EOS token: set one "
                "(tokenizer.pad_token = ...) before passing it as a reward processing class."
            )
        tokenizer.pad_token = tokenizer.eos_token
    # The classifier pools the last non-pad token: it must know which id is padding.
    config = getattr(model, "config", None)
    if config is not None:
        config.pad_token_id = tokenizer.pad_token_id
        if hasattr(config, "get_text_config"):
            config.get_text_config().pad_token_id = tokenizer.pad_token_id


def _config_name(model: torch.nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")


def _model_name(source: Any, model: torch.nn.Module) -> str:
    path = str(source) if isinstance(source, (str, os.PathLike)) else _config_name(model)
    base = os.path.basename(path.rstrip("/\\")) if path else ""
    return base or type(model).__name__

"""Reading a model config whatever its shape (layer L0).

A vision-language model's config keeps the language model's settings (hidden size, vocabulary,
logit soft-capping) in a sub-config that ``get_text_config()`` returns; a text model's config
is its own text config.
"""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """The language model's part of ``config`` (``config`` itself for a text model).

    >>> class Plain: hidden_size = 8
    >>> text_config(Plain).hidden_size
    8
    """
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config

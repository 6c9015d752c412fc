"""Which setting a user error belongs to: a component's own check names its argument
(``epsilon=-1.0: it must be >= 0.0.``), and ``grpo`` adds where that argument lives in the config
(``model.loss.init_args.epsilon=-1.0: ...``). Python callers see the component's own message."""

from __future__ import annotations

import re
from typing import Mapping

_ARGUMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def component_key(error: BaseException, components: Mapping[str, type]) -> str | None:
    """The config key (``model.loss``) of the component whose constructor raised ``error``: the
    outermost ``__init__`` frame of the traceback whose ``self`` is an instance of one of
    ``components``' base classes. ``None`` when it was raised elsewhere."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            for key, base in components.items():
                if isinstance(owner, base):
                    return key
        tb = tb.tb_next
    return None


def with_setting(message: str, key: str | None) -> str:
    """``message`` with the component's config key in front of the argument it names.

    >>> with_setting("epsilon=-1.0: it must be >= 0.0.", "model.loss")
    'model.loss.init_args.epsilon=-1.0: it must be >= 0.0.'
    >>> with_setting("The 'dr_grpo' loss divides by max_completion_length.", "model.loss")
    "model.loss: The 'dr_grpo' loss divides by max_completion_length."
    >>> with_setting("epsilon=-1.0: it must be >= 0.0.", None)
    'epsilon=-1.0: it must be >= 0.0.'
    """
    if key is None or message.startswith(key):
        return message
    if _ARGUMENT.match(message):
        return f"{key}.init_args.{message}"
    return f"{key}: {message}"

"""User errors, and when ``grpo`` prints one as a single message instead of a traceback.

The rule (``grpo`` only; Python callers always get the exception):

* a :class:`ConfigError` is always a user error: a setting, a file or the data is wrong, and the
  message names the setting and the fix;
* a ``ValueError``, ``TypeError``, ``OSError`` (``FileNotFoundError``, ...) or ``ImportError``
  raised by grpo_lightning's own validation (the ``raise`` is in this package) before the first
  optimizer step is a user error too: bad config, data or reward functions show up then;
* anything else (an error in torch, transformers or a user's function, or any error once training
  has taken a step) may be a bug and keeps its full traceback, unless it was raised ``from`` a
  user error (jsonargparse wraps the checks of settings inside a union type): that one is printed.

``GRPO_DEBUG=1`` always shows the full traceback (and jsonargparse's own for parser errors).

Layer L0: the standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

DEBUG_ENV = "GRPO_DEBUG"
DEBUG_HINT = f"(set {DEBUG_ENV}=1 to see the full traceback)"
_PACKAGE_DIR = Path(__file__).resolve().parent
_CHECKED_TYPES = (ValueError, TypeError, OSError, ImportError)


class ConfigError(ValueError):
    """A setting, a file or the data of a run is wrong; the message names the setting and the fix."""


def debug_enabled() -> bool:
    """Whether ``GRPO_DEBUG`` asks for full tracebacks (any value but empty, 0, false, no, off)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def raised_in_package(error: BaseException) -> bool:
    """Whether the ``raise`` of ``error`` (its innermost traceback frame) is in grpo_lightning."""
    tb: TracebackType | None = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    try:
        Path(tb.tb_frame.f_code.co_filename).resolve().relative_to(_PACKAGE_DIR)
    except ValueError:
        return False
    return True


def is_user_error(error: BaseException, *, training_started: bool) -> bool:
    """Whether ``grpo`` prints ``error`` as one message (see the module docstring for the rule)."""
    if isinstance(error, ConfigError):
        return True
    return isinstance(error, _CHECKED_TYPES) and not training_started and raised_in_package(error)


def find_user_error(error: BaseException, *, training_started: bool) -> BaseException | None:
    """``error`` if it is a user error, else the first user error it was raised ``from``: a setting
    nested in a union (``model.peft_config``, ``model.loss.init_args``, ...) reaches ``grpo`` as
    jsonargparse's "Does not validate against any of the Union subtypes", raised from our check's
    error. ``None`` when there is none (``__context__``, an error while handling another, is not followed)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if is_user_error(current, training_started=training_started):
            return current
        seen.add(id(current))
        current = current.__cause__
    return None


def user_message(error: BaseException, text: str | None = None) -> str:
    """The text ``grpo`` prints for a user error: the message (``text`` in its place, when
    given), then how to see the traceback."""
    text = text or str(error) or type(error).__name__
    return f"error: {text}\n{DEBUG_HINT}"

"""Component defaults declared with jsonargparse's ``lazy_instance``.

A constructor default such as ``loss: PolicyLoss | str = lazy_instance(DAPOLoss)`` lets the CLI
show, save and override every knob of the default component (``--model.loss.epsilon 0.3``). The
default object itself is created once, when the signature is defined, and is shared by every call;
and until one of its methods runs it has none of its attributes. :func:`fresh_instance` turns it
into a new, initialised instance of its class with the same arguments.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def fresh_instance(value: T) -> T:
    """A new instance for a ``lazy_instance`` default; any other value unchanged.

    >>> from jsonargparse import lazy_instance
    >>> class Knob:
    ...     def __init__(self, size: int = 1):
    ...         self.size = size
    >>> default = lazy_instance(Knob, size=3)
    >>> made = fresh_instance(default)
    >>> type(made) is Knob, made.size, made is not fresh_instance(default)
    (True, 3, True)
    """
    init_args = getattr(value, "lazy_get_init_args", None)
    if init_args is None:
        return value
    cls: Any = type(value).__bases__[-1]  # lazy_instance subclasses (its lazy base, the class)
    return cls(**init_args().as_dict())

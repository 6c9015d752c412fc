"""A field with its help text, as every field of :class:`~grpo_lightning.trl_compat.GRPOConfig` is declared.

Layer L7 (trl_compat): the standard library only.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, field
from typing import Any, Callable


def option(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with ``metadata["help"]`` (what ``--help`` and the docs show).

    >>> from dataclasses import dataclass, fields
    >>> @dataclass
    ... class Knobs:
    ...     size: int = option(3, "How many.")
    >>> fields(Knobs)[0].metadata["help"], Knobs().size
    ('How many.', 3)
    """
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def help_of(f: Field) -> str:
    """The help text of a field declared with :func:`option`."""
    return str(f.metadata.get("help", ""))

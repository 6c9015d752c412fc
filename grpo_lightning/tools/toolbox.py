"""The tools one rollout may call: name -> function, with each function's JSON schema.

Layer L1: the standard library only.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from grpo_lightning.tools.schema import tool_name, tool_schema


@dataclass(frozen=True)
class Tool:
    """One callable tool.

    Attributes:
        name: The name the model calls it by.
        func: The function (or bound method) run with the call's arguments.
        schema: Its ``{"type": "function", ...}`` JSON schema for the chat template.
        is_async: Calling it returns a coroutine (``async def``).
    """

    name: str
    func: Callable[..., Any]
    schema: dict[str, Any]
    is_async: bool

    @classmethod
    def of(cls, func: Callable[..., Any], schema: dict[str, Any] | None = None) -> "Tool":
        """A tool for ``func``; its schema is read from the signature and docstring unless given."""
        if not callable(func):
            raise TypeError(f"tool {func!r} is not callable: a tool is a Python function with type hints.")
        return cls(tool_name(func), func, schema or tool_schema(func), is_async_function(func))

    def bound_to(self, func: Callable[..., Any]) -> "Tool":
        """The same tool (same schema) running ``func``: an environment method bound to another instance."""
        return Tool(self.name, func, self.schema, self.is_async)


def is_async_function(func: Callable[..., Any]) -> bool:
    """Whether calling ``func`` returns a coroutine (partials unwrapped)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


class Toolbox(Mapping[str, Tool]):
    """An ordered, read-only name -> :class:`Tool` mapping (the order of the schemas in the prompt).

    Raises:
        ValueError: When two tools have the same name.
    """

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise ValueError(
                    f"two tools are named '{tool.name}': tool names must be unique within a rollout (a standalone "
                    "tool and an environment method, or two environment methods, clash); rename one of them."
                )
            self._tools[tool.name] = tool

    @classmethod
    def of(cls, funcs: Iterable[Callable[..., Any]]) -> "Toolbox":
        return cls(Tool.of(f) for f in funcs)

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __iter__(self):
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def __or__(self, other: "Toolbox") -> "Toolbox":
        return Toolbox([*self.values(), *other.values()])

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The JSON schemas, in order (``apply_chat_template(tools=...)``)."""
        return [tool.schema for tool in self.values()]

    def __repr__(self) -> str:
        return f"Toolbox({list(self)})"


__all__ = ["Tool", "Toolbox", "is_async_function"]

"""A tool's JSON schema, read from its signature (type hints) and its Google-style docstring.

The schema has the layout chat templates expect for ``apply_chat_template(tools=[...])``::

    {"type": "function", "function": {"name": ..., "description": ...,
     "parameters": {"type": "object", "properties": {...}, "required": [...]},
     "return": {...}}}

Layer L1: the standard library only.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from typing import Any, Callable, Literal, Union


class ToolSchemaError(ValueError):
    """A tool cannot be described to the model (missing type hint, docstring or argument doc)."""


_PRIMITIVES: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Return|Yields|Raises|Examples?|Notes?):\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def tool_name(func: Callable[..., Any]) -> str:
    """The name the model calls a tool by: the function's (or bound method's) ``__name__``."""
    return getattr(func, "__name__", type(func).__name__)


def tool_schema(func: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``func`` for the chat template.

    Args:
        func: A function or bound method whose parameters all have type hints and whose
            docstring describes it, each parameter (``Args:``) and, optionally, ``Returns:``.

    Returns:
        The ``{"type": "function", "function": {...}}`` schema.

    Raises:
        ToolSchemaError: Naming the tool and what is missing.

    >>> def add(a: int, b: int = 0) -> int:
    ...     '''Adds two integers.
    ...
    ...     Args:
    ...         a: The first integer.
    ...         b: The second integer.
    ...
    ...     Returns:
    ...         The sum.
    ...     '''
    ...     return a + b
    >>> tool_schema(add)["function"]["parameters"]["required"]
    ['a']
    """
    name = tool_name(func)
    doc = inspect.getdoc(func)
    if not doc or not doc.strip():
        raise ToolSchemaError(
            f"tool '{name}' has no docstring: give it a Google-style docstring (a description, an 'Args:' "
            "section with one line per parameter and a 'Returns:' section) so the model knows how to call it."
        )
    description, arg_docs, returns_doc = parse_google_docstring(doc)
    try:
        hints = typing.get_type_hints(func)
    except Exception as err:  # unresolvable forward references
        raise ToolSchemaError(f"tool '{name}': its type hints cannot be resolved ({err}).") from err
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(func).parameters.values():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise ToolSchemaError(
                f"tool '{name}' takes *{param.name}/**{param.name}: a tool's parameters must be named one by one, "
                "each with a type hint, so they can be described to the model."
            )
        if param.name not in hints:
            raise ToolSchemaError(f"tool '{name}': parameter '{param.name}' has no type hint; add one (e.g. int, str).")
        if param.name not in arg_docs:
            raise ToolSchemaError(
                f"tool '{name}': parameter '{param.name}' is not described in the docstring's 'Args:' section; "
                f"add a line '{param.name}: <what it is>'."
            )
        prop = type_schema(hints[param.name], f"tool '{name}', parameter '{param.name}'")
        prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        function["return"] = type_schema(hints["return"], f"tool '{name}', return type")
        if returns_doc:
            function["return"]["description"] = returns_doc
    return {"type": "function", "function": function}


def parse_google_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """Split a cleaned (``inspect.getdoc``) Google-style docstring.

    Returns:
        The description (the text before the first section), the ``Args:`` descriptions by
        parameter name (continuation lines joined with spaces) and the ``Returns:`` text.

    >>> parse_google_docstring("Adds.\\n\\nArgs:\\n    a: First\\n        one.\\n\\nReturns:\\n    Sum.")
    ('Adds.', {'a': 'First one.'}, 'Sum.')
    """
    sections: dict[str, list[str]] = {"": []}
    current = ""
    for line in doc.splitlines():
        header = _SECTION.match(line.strip()) if not line[:1].isspace() else None
        if header:
            current = header.group(1).lower()
            sections.setdefault(current, [])
            continue
        sections[current].append(line)
    description = "\n".join(sections[""]).strip()  # its line breaks kept, as transformers renders it
    arg_lines = sections.get("args") or sections.get("arguments") or sections.get("parameters") or []
    returns = sections.get("returns") or sections.get("return")
    return description, _arg_descriptions(arg_lines), _join(returns) if returns else None


def _arg_descriptions(lines: list[str]) -> dict[str, str]:
    """``name: text`` entries at the section's first indentation; deeper lines continue the entry."""
    entries: dict[str, list[str]] = {}
    indent: int | None = None
    name: str | None = None
    for line in lines:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        match = _ARG_LINE.match(line.strip())
        if match and (indent is None or depth <= indent):
            indent, name = depth, match.group(1).lstrip("*")
            entries[name] = [match.group(3)]
        elif name is not None:
            entries[name].append(line.strip())
    return {key: _join(value) for key, value in entries.items()}


def _join(lines: list[str]) -> str:
    return " ".join(part.strip() for part in lines if part.strip())


def type_schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one type hint: ``int``, ``float``, ``str``, ``bool``, ``None``, ``Any``,
    ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``, ``Literal[...]``, ``Enum`` subclasses,
    ``X | None`` (``nullable``) and other unions.

    >>> type_schema(list[int], "x"), type_schema(int | None, "x")
    ({'type': 'array', 'items': {'type': 'integer'}}, {'type': 'integer', 'nullable': True})
    """
    if hint is Any or hint is inspect.Parameter.empty:
        return {}
    if hint in _PRIMITIVES:
        return {"type": _PRIMITIVES[hint]}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [member.value for member in hint]
        return {**_literal_type(values), "enum": values}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return {**_literal_type(list(args)), "enum": list(args)}
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        nullable = len(members) < len(args)
        if len(members) == 1:
            schema = type_schema(members[0], where)
        elif all(m in _PRIMITIVES for m in members):
            schema = {"type": [_PRIMITIVES[m] for m in members]}
        else:
            schema = {"anyOf": [type_schema(m, where) for m in members]}
        if nullable:
            schema["nullable"] = True
        return schema
    if hint in (list, tuple, set, frozenset) or origin in (list, set, frozenset, typing.Sequence, _abc("Sequence")):
        return {"type": "array", **({"items": type_schema(args[0], where)} if args else {})}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": type_schema(args[0], where)}
        return {"type": "array", "prefixItems": [type_schema(a, where) for a in args]}
    if hint is dict or origin in (dict, typing.Mapping, _abc("Mapping")):
        return {"type": "object", **({"additionalProperties": type_schema(args[1], where)} if len(args) == 2 else {})}
    raise ToolSchemaError(
        f"{where}: the type {hint!r} cannot be described in JSON; use int, float, str, bool, list[...], "
        "dict[str, ...], Literal[...], an Enum, or a union of these."
    )


def _abc(name: str) -> Any:
    import collections.abc

    return getattr(collections.abc, name)


def _literal_type(values: list[Any]) -> dict[str, Any]:
    kinds = {type(v) for v in values}
    if len(kinds) == 1 and next(iter(kinds)) in _PRIMITIVES:
        return {"type": _PRIMITIVES[next(iter(kinds))]}
    return {}


__all__ = ["ToolSchemaError", "parse_google_docstring", "tool_name", "tool_schema", "type_schema"]

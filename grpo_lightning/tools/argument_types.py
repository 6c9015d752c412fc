"""Tool-call arguments read as the types the tool's schema declares.

Models often write numbers and flags as strings (``{"a": "3"}`` for an ``int`` parameter). Python
would run ``multiply("3", 4)`` and return ``"3333"``: a wrong answer, silently, not a failure.
transformers' response parsing (which TRL uses from transformers 5.15) converts such strings to the
declared JSON-schema type, and so do we, before the call is bound:

* ``integer``: ``"3"`` and ``"3.0"`` become ``3``; ``"3.5"`` stays a string;
* ``number``: ``"2.5"`` becomes ``2.5`` (``"2"`` becomes ``2``); NaN and infinities stay strings;
* ``boolean``: ``"true"``/``"1"`` and ``"false"``/``"0"`` (any case);
* ``null``: ``"null"``/``"None"`` for an ``Optional`` parameter;
* ``object`` / ``array``: a string holding that JSON value.

Only string values are converted, a union tries its types in order, and a value that fits none of
them (or a ``string`` parameter, or one the schema does not describe) is passed as written.

Layer L1: the standard library only.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable


def schema_types(schema: Any) -> tuple[str, ...]:
    """The JSON-schema type names a parameter accepts, in order (``anyOf``/``oneOf`` flattened,
    ``nullable`` as ``"null"``).

    >>> schema_types({"type": "integer", "nullable": True})
    ('integer', 'null')
    >>> schema_types({"anyOf": [{"type": "number"}, {"type": "string"}]})
    ('number', 'string')
    """
    if not isinstance(schema, dict):
        return ()
    declared = schema.get("type")
    names = [declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)]
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or ():
            names.extend(schema_types(choice))
    if schema.get("nullable") and "null" not in names:
        names.append("null")
    return tuple(names)


def _integer(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        number = float(text)
        if not number.is_integer():
            raise
        return int(number)


def _number(text: str) -> Any:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(text)
    return int(number) if number.is_integer() and "." not in text else number


def _boolean(text: str) -> bool:
    word = text.strip().lower()
    if word not in ("true", "1", "false", "0"):
        raise ValueError(text)
    return word in ("true", "1")


def _null(text: str) -> None:
    if text.strip() not in ("null", "None"):
        raise ValueError(text)


def _json_of(kind: type) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        value = json.loads(text)
        if not isinstance(value, kind):
            raise ValueError(text)
        return value

    return read


_READERS: dict[str, Callable[[str], Any]] = {
    "integer": _integer, "number": _number, "boolean": _boolean, "null": _null,
    "object": _json_of(dict), "array": _json_of(list),
}  # fmt: skip


def coerce_value(text: str, types: tuple[str, ...]) -> Any:
    """``text`` as the first of ``types`` it reads as; ``text`` itself when ``"string"`` comes
    first or none fits.

    >>> coerce_value("3", ("integer",)), coerce_value("3.5", ("integer",)), coerce_value("no", ("boolean",))
    (3, '3.5', 'no')
    """
    for name in types:
        if name == "string":
            return text
        reader = _READERS.get(name)
        if reader is None:
            continue
        try:
            return reader(text)
        except ValueError:
            continue
    return text


def coerce_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` with each string value read as its parameter's declared type (a new dict).

    Args:
        arguments: The call's arguments as the model wrote them.
        schema: The tool's ``{"type": "function", "function": {"parameters": ...}}`` schema.

    >>> schema = {"function": {"parameters": {"properties": {"a": {"type": "integer"}, "s": {"type": "string"}}}}}
    >>> coerce_arguments({"a": "3", "s": "3", "extra": "3"}, schema)
    {'a': 3, 's': '3', 'extra': '3'}
    """
    properties = ((schema.get("function") or {}).get("parameters") or {}).get("properties") or {}
    coerced = dict(arguments)
    for key, value in arguments.items():
        types = schema_types(properties.get(key))
        if isinstance(value, str) and types:
            coerced[key] = coerce_value(value, types)
    return coerced


__all__ = ["coerce_arguments", "coerce_value", "schema_types"]

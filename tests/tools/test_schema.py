"""Tool schemas from type hints and Google docstrings: the layout transformers renders for
``apply_chat_template(tools=[func])``, and one clear error per missing piece."""

from __future__ import annotations

import enum
from typing import Any, Literal, Optional

import pytest

from grpo_lightning.tools import ToolSchemaError, tool_schema


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def rich(text: str, scale: float, flags: list[bool], weights: dict[str, float], mode: Literal["fast", "slow"],
         maybe: Optional[int] = None, color: Color = Color.RED, anything: Any = None) -> list:
    """Does many things at once,
    over two lines.

    Args:
        text: Some text.
        scale: A scale factor that is described
            over two lines.
        flags: Boolean flags.
        weights: Weights by name.
        mode: How fast.
        maybe: An optional count.
        color: A color.
        anything: Whatever.

    Returns:
        A list of results.
    """
    return []


class Counter:
    def increment(self, step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        return step


@pytest.mark.parametrize("func", [multiply, async_add, rich, Counter().increment], ids=lambda f: f.__name__)
def test_schema_equals_transformers(func):
    import transformers
    from packaging.version import Version
    from transformers.utils import get_json_schema

    if Version(transformers.__version__) < Version("5.24") and func is rich:
        pytest.skip("transformers < 5.24 types a list return as 'object'; the schema follows 5.24's 'array'")

    assert tool_schema(func) == get_json_schema(func)


def test_seed_example_exactly():
    assert tool_schema(multiply) == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiplies two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "description": "The first integer."},
                               "b": {"type": "integer", "description": "The second integer."}},
                "required": ["a", "b"],
            },
            "return": {"type": "integer", "description": "The product of the two integers."},
        },
    }


def no_doc(a: int) -> int:
    return a


def no_hint(a) -> int:
    """Does.

    Args:
        a: A.
    """


def undocumented_arg(a: int, b: int) -> int:
    """Does.

    Args:
        a: A.
    """


def star_args(*values: int) -> int:
    """Does.

    Args:
        values: Values.
    """


def bad_type(a: object) -> int:
    """Does.

    Args:
        a: A.
    """


@pytest.mark.parametrize("func, words", [
    (no_doc, "has no docstring"), (no_hint, "'a' has no type hint"), (undocumented_arg, "parameter 'b' is not described"),
    (star_args, "*values"), (bad_type, "cannot be described in JSON"),
])
def test_schema_errors_name_the_tool_and_the_fix(func, words):
    with pytest.raises(ToolSchemaError, match=func.__name__) as err:
        tool_schema(func)
    assert words in str(err.value)

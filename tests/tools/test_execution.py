"""Executing tool calls: results in call order, async calls concurrent, every failure (unknown
tool, bad arguments, exception, timeout) an error message, never a crash."""

from __future__ import annotations

import asyncio
import json
import time

from grpo_lightning.tools import ToolCall, Toolbox, execute_calls


def multiply(a: int, b: int) -> int:
    """Multiplies.

    Args:
        a: First.
        b: Second.
    """
    return a * b


async def slow_add(a: int, b: int) -> int:
    """Adds slowly.

    Args:
        a: First.
        b: Second.
    """
    await asyncio.sleep(0.3)
    return a + b


def divide(a: int, b: int) -> float:
    """Divides.

    Args:
        a: First.
        b: Second.
    """
    return a / b


def hang(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


async def async_hang(seconds: float) -> str:
    """Sleeps asynchronously.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "done"


def picture() -> list:
    """A picture.

    Returns:
        Content blocks.
    """
    return [{"type": "image", "image": "IMG"}, {"type": "text", "text": "a cat"}]


TOOLS = Toolbox.of([multiply, slow_add, divide, hang, async_hang, picture])


def error(result) -> str:
    return json.loads(result.content)["error"]


def test_results_in_call_order_and_async_calls_concurrent():
    calls = [[ToolCall("slow_add", {"a": 1, "b": 2}), ToolCall("multiply", {"a": 3, "b": 4}),
              ToolCall("slow_add", {"a": 5, "b": 6})], [ToolCall("slow_add", {"a": 0, "b": 1})]]
    started = time.perf_counter()
    results = execute_calls(calls, [TOOLS, TOOLS], timeout_s=5)
    took = time.perf_counter() - started
    assert [[r.content for r in row] for row in results] == [["3", "12", "11"], ["1"]]
    assert not any(r.failed for row in results for r in row)
    assert took < 0.8, f"three 0.3 s async calls took {took:.2f} s: not concurrent"
    assert results[0][1].message() == {"role": "tool", "name": "multiply", "content": "12"}


def test_every_failure_is_a_result():
    calls = [[ToolCall("nope", {}), ToolCall("multiply", {"a": 1, "c": 2}), ToolCall("divide", {"a": 1, "b": 0}),
              ToolCall("hang", {"seconds": 3}), ToolCall("async_hang", {"seconds": 3}),
              ToolCall("multiply", {"a": 2, "b": 2}, type="code")]]
    started = time.perf_counter()
    (row,) = execute_calls(calls, [TOOLS], timeout_s=0.2)
    assert time.perf_counter() - started < 1.5
    assert all(r.failed for r in row)
    assert "Tool nope not found" in error(row[0]) and "multiply" in error(row[0])  # the available tools are listed
    assert error(row[1]).startswith("Bad arguments for tool multiply")
    assert error(row[2]) == "ZeroDivisionError: division by zero"
    assert error(row[3]) == "Tool hang timed out after 0.2 s."
    assert error(row[4]) == "Tool async_hang timed out after 0.2 s."
    assert error(row[5]) == "Unsupported tool call type: code"


def test_content_blocks_are_kept():
    (row,) = execute_calls([[ToolCall("picture", {})]], [TOOLS])
    assert row[0].content == [{"type": "image", "image": "IMG"}, {"type": "text", "text": "a cat"}]


def test_rows_see_only_their_tools():
    only_multiply = Toolbox.of([multiply])
    rows = execute_calls([[ToolCall("divide", {"a": 4, "b": 2})]] * 2, [TOOLS, only_multiply])
    assert rows[0][0].content == "2.0" and rows[1][0].failed


def primes() -> list[int]:
    """Primes.

    Returns:
        Some primes.
    """
    return [2, 3, 5]


def concat(text: str, times: int, flag: bool = False, ratio: float | None = None) -> str:
    """Repeats.

    Args:
        text: Text.
        times: How often.
        flag: A flag.
        ratio: A ratio.
    """
    return repr((text * times, flag, ratio))


def test_a_list_that_is_not_content_blocks_is_text():
    """A list of numbers or strings is the message's text (TRL renders it so), not content blocks
    a text-only template would drop."""
    (row,) = execute_calls([[ToolCall("primes", {})]], [Toolbox.of([primes])])
    assert row[0].content == "[2, 3, 5]" and not row[0].failed


def test_arguments_are_read_as_the_schema_types():
    """``"3"`` for an ``int`` parameter is 3 (not ``"3" * 4``), as transformers' response parsing
    reads it for TRL; a ``str`` parameter keeps its text and an unreadable value is passed as is."""
    tools = Toolbox.of([multiply, concat])
    (row,) = execute_calls([[ToolCall("multiply", {"a": "3", "b": "4.0"}),
                             ToolCall("concat", {"text": "7", "times": "2", "flag": "true", "ratio": "0.5"}),
                             ToolCall("concat", {"text": "a", "times": "1", "ratio": "null"}),
                             ToolCall("multiply", {"a": "three", "b": 2})]], [tools])
    assert [r.content for r in row[:3]] == ["12", repr(("77", True, 0.5)), repr(("a", False, None))]
    assert row[3].content == "threethree"  # as written: the tool decides what "three" means


def test_sync_tools_without_a_timeout_run_on_the_training_thread():
    import threading

    def where() -> str:
        """The thread.

        Returns:
            Its name.
        """
        return threading.current_thread().name

    (row,) = execute_calls([[ToolCall("where", {})]], [Toolbox.of([where])], timeout_s=None)
    assert row[0].content == threading.current_thread().name
    (row,) = execute_calls([[ToolCall("where", {})]], [Toolbox.of([where])], timeout_s=5)
    assert row[0].content == "tool-where"


async def fetch_page(url: str) -> str:
    """Fetch a page; its request task gets cancelled (a client's own cancellation).

    Args:
        url: The address.
    """
    request = asyncio.ensure_future(asyncio.sleep(10))
    asyncio.get_running_loop().call_soon(request.cancel)
    return await request  # raises CancelledError inside the tool


def stop_now() -> str:
    """A sync tool raising CancelledError.
    """
    raise asyncio.CancelledError()


def test_a_cancelled_error_out_of_a_tool_is_that_tool_s_failure():
    """A tool's own ``CancelledError`` (a ``BaseException``) fails that call only: the other calls
    and rows go on, with and without a timeout."""
    tools = Toolbox.of([fetch_page, stop_now, multiply])
    calls = [[ToolCall("fetch_page", {"url": "x"}), ToolCall("multiply", {"a": 2, "b": 3})], [ToolCall("stop_now", {})]]
    for timeout_s in (None, 5.0):
        first, second = execute_calls(calls, [tools, tools], timeout_s=timeout_s)
        assert first[0].failed and error(first[0]) == "CancelledError"
        assert not first[1].failed and first[1].content == "6"
        assert second[0].failed and error(second[0]) == "CancelledError"

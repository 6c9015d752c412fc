"""Running the tool calls of a batch of rollouts, each with a timeout; a failure is a result.

An unknown tool, arguments that do not fit the signature, an exception and a timeout all become
an ``{"error": ...}`` tool message that the model reads in its next turn (and count in
``tools/failure_frequency``); none of them stops training. Order, as in TRL: within a row the
synchronous calls run one after another in call order, then its ``async def`` calls run
concurrently; the async calls of all rows of a batch run concurrently with each other.

Arguments are first read as the types the tool's schema declares (``"3"`` for an ``int`` is 3;
``tools/argument_types.py``). A synchronous call runs on the training thread when there is no
timeout; with one it runs on a worker thread, and one that overruns is abandoned, not killed
(Python cannot stop a thread): its daemon thread may finish later and its result is dropped.

Layer L1: the standard library (and the package's background event loop).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from grpo_lightning.tools.argument_types import coerce_arguments
from grpo_lightning.tools.parsers import ToolCall
from grpo_lightning.tools.toolbox import Tool, Toolbox
from grpo_lightning.utils import async_loop


@dataclass
class ToolResult:
    """What one call returned.

    Attributes:
        call: The call.
        content: The tool message content: the result as text, or, for a tool returning a list
            of content blocks (``{"type": "text" | "image", ...}``), that list.
        error: Why the call failed (``None`` when it succeeded).
    """

    call: ToolCall
    content: str | list[Any]
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def message(self) -> dict[str, Any]:
        """The ``{"role": "tool", "name", "content"}`` message appended to the conversation."""
        return {"role": "tool", "name": self.call.name, "content": self.content}


def failure(call: ToolCall, error: str) -> ToolResult:
    return ToolResult(call, json.dumps({"error": error}), error)


def execute_calls(
    calls: Sequence[Sequence[ToolCall]], toolboxes: Sequence[Toolbox], timeout_s: float | None = 30.0
) -> list[list[ToolResult]]:
    """Run every row's calls against that row's tools.

    Args:
        calls: Per row, the calls of its last turn.
        toolboxes: Per row, the tools it may call.
        timeout_s: Seconds one call may take (``None``: no limit).

    Returns:
        Per row, one :class:`ToolResult` per call, in call order.
    """
    results: list[list[ToolResult | None]] = [[None] * len(row) for row in calls]
    pending: list[tuple[int, int, Tool, dict[str, Any]]] = []
    for r, (row, toolbox) in enumerate(zip(calls, toolboxes)):
        for c, call in enumerate(row):
            tool, arguments, problem = _resolve(call, toolbox)
            if problem is not None:
                results[r][c] = failure(call, problem)
            elif tool.is_async:
                pending.append((r, c, tool, arguments))
            else:
                results[r][c] = _run_sync(call, tool, arguments, timeout_s)
    if pending:
        outcomes = async_loop.gather(_run_async(tool, arguments, timeout_s) for _, _, tool, arguments in pending)
        for (r, c, tool, _), (value, error) in zip(pending, outcomes):
            call = calls[r][c]
            results[r][c] = failure(call, error) if error is not None else _success(call, value)
    return [[result for result in row if result is not None] for row in results]


def _resolve(call: ToolCall, toolbox: Toolbox) -> tuple[Tool, dict[str, Any], None] | tuple[None, None, str]:
    """The tool a call names and its arguments read as the schema's types, or why it cannot run."""
    if call.type != "function":
        return None, None, f"Unsupported tool call type: {call.type}"
    tool = toolbox.get(call.name)
    if tool is None:
        available = ", ".join(toolbox) or "none"
        return None, None, f"Tool {call.name} not found (available tools: {available})."
    arguments = coerce_arguments(call.arguments, tool.schema)
    try:
        inspect.signature(tool.func).bind(**arguments)
    except TypeError as err:
        return None, None, f"Bad arguments for tool {call.name}: {err}"
    return tool, arguments, None


def _success(call: ToolCall, value: Any) -> ToolResult:
    """A list of content blocks (dicts with a ``type``: text, images) stays a list; any other
    value, a list of numbers or strings included, is the tool message's text, as in TRL."""
    if isinstance(value, list) and value and all(isinstance(v, dict) and "type" in v for v in value):
        return ToolResult(call, list(value))
    return ToolResult(call, str(value))


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _run_sync(call: ToolCall, tool: Tool, arguments: dict[str, Any], timeout_s: float | None) -> ToolResult:
    """One synchronous call: inline on the calling thread without a timeout (as TRL: state bound
    to a thread, a ``sqlite3`` connection say, works), on a worker thread that can be abandoned
    with one."""
    if timeout_s is None:
        try:
            value = tool.func(**arguments)
        except (Exception, asyncio.CancelledError) as err:  # the tool's error is the model's feedback
            return failure(call, _describe(err))
    else:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = tool.func(**arguments)
            except BaseException as err:  # the tool's error is the model's feedback
                box["error"] = err

        worker = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            return failure(call, f"Tool {call.name} timed out after {timeout_s} s.")
        if "error" in box:
            return failure(call, _describe(box["error"]))
        value = box.get("value")
    if inspect.isawaitable(value):  # a sync wrapper returning a coroutine
        value, error = async_loop.run(_run_async_value(value, timeout_s, call.name))
        return failure(call, error) if error is not None else _success(call, value)
    return _success(call, value)


async def _run_async(tool: Tool, arguments: dict[str, Any], timeout_s: float | None) -> tuple[Any, str | None]:
    try:
        coroutine = tool.func(**arguments)
    except Exception as err:
        return None, _describe(err)
    return await _run_async_value(coroutine, timeout_s, tool.name)


async def _run_async_value(awaitable: Any, timeout_s: float | None, name: str) -> tuple[Any, str | None]:
    try:
        return await asyncio.wait_for(awaitable, timeout_s), None
    except asyncio.TimeoutError:
        return None, f"Tool {name} timed out after {timeout_s} s."
    except asyncio.CancelledError as err:
        if _being_cancelled():
            raise  # the step itself is stopping: let the cancellation through
        return None, _describe(err)  # the tool's own (a cancelled inner task it awaited): its failure
    except Exception as err:
        return None, _describe(err)


def _being_cancelled() -> bool:
    """Whether the running task was asked to stop (``Task.cancelling``, Python 3.11+; on 3.10 a
    ``CancelledError`` out of a tool is taken as the tool's)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling and cancelling())


__all__ = ["ToolResult", "execute_calls", "failure"]

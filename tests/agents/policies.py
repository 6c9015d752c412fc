"""Scripted policies for the CPU runs of configs/agents/ (``ScriptedSampler(script=...)`` from
YAML): they emit tool calls in Qwen's ``<tool_call>`` JSON, whatever the tokenizer."""

from __future__ import annotations

import re

from tests.agents.scripted import call

# The turn markers of a tool result: Qwen's and the tiny char tokenizer's chat templates.
TOOL_MARKERS = ("<tool_response>", "<|tool|>")


def _tool_result(context: str) -> str | None:
    for marker, end in (("<tool_response>\n", "\n</tool_response>"), ("<|tool|>", "<|end|>")):
        if marker in context:
            return context.rsplit(marker, 1)[1].split(end, 1)[0]
    return None


def calculator_policy(context: str, k: int) -> str:
    """Calls calculate on the prompt's sum, then answers with the tool's result (odd rows add 1,
    so rewards differ within a group)."""
    result = _tool_result(context)
    if result is not None:
        return result if k % 2 == 0 or not result.isdigit() else str(int(result) + 1)
    numbers = re.findall(r"(\d+)\s*\+\s*(\d+)", context)
    a, b = numbers[-1] if numbers else ("1", "1")
    return call("calculate", expression=f"{a}+{b}")


def increment_policy(context: str, k: int) -> str:
    """Increments by the asked amount (odd rows overshoot by one), then says it is done."""
    if _tool_result(context) is not None:
        return "Done."
    targets = re.findall(r"Increment the counter by (\d+)", context)
    return call("increment", step=int(targets[-1]) + k % 2 if targets else 1)

"""What a tool-call parser returns, its interface, and the readers the families share.

Layer L1: the standard library only.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for."""

    name: str
    arguments: dict[str, Any]
    type: str = "function"

    def message(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (chat-template format)."""
        return {"type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class AssistantTurn:
    """A parsed assistant turn.

    Attributes:
        content: The text outside the tool-call (and thinking) markup, stripped.
        tool_calls: The calls, in order (empty for a plain answer).
        reasoning_content: The thinking text, for families that have one.
        malformed: The turn had tool-call markup that could not be read (so it calls nothing).
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning_content: str | None = None
    malformed: bool = False

    def message(self) -> dict[str, Any]:
        """The turn as a chat message (``tool_calls`` only when there are some)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.message() for call in self.tool_calls]
        return message


class ToolCallParser(ABC):
    """Turns the decoded text of one assistant turn (end-of-turn token removed) into an
    :class:`AssistantTurn`. Subclass it for another family and select it by dotted path."""

    #: Marker whose presence in a chat template means this format (for detection); "" = never detected.
    template_marker: ClassVar[str] = ""
    #: The most calls one assistant turn can hold (``None``: any number). The template check then
    #: renders exchanges of at most that many calls (Llama 3.1/3.2's template refuses two).
    max_calls_per_turn: ClassVar[int | None] = None

    @abstractmethod
    def parse(self, text: str) -> AssistantTurn:
        """Parse one turn; never raises on model output (unreadable markup → ``malformed``)."""


def split_think(text: str) -> tuple[str | None, str]:
    """``(thinking, rest)`` around the first ``</think>`` (``None``: the turn has no thinking)."""
    if "</think>" not in text:
        return None, text
    thought, _, rest = text.partition("</think>")
    return thought.replace("<think>", "", 1).strip(), rest


def read_arguments(body: str) -> dict[str, Any] | None:
    """A call's JSON arguments (empty: none); ``None`` when they are not a JSON object."""
    if not body.strip():
        return {}
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    return arguments if isinstance(arguments, dict) else None


def read_call(body: str) -> ToolCall | None:
    """One block's JSON as a call; ``None`` when it is not ``{"name": str, "arguments": {...}}``."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return None
    arguments = payload.get("arguments", payload.get("parameters"))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(payload["name"], arguments)


__all__ = ["AssistantTurn", "ToolCall", "ToolCallParser", "read_arguments", "read_call", "split_think"]

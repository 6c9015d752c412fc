"""Reading tool calls out of a generated assistant turn, one parser per model family.

Qwen2.5 and Qwen3 (Hermes format) write each call as ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``; Qwen3 may open the turn with a ``<think>...</think>`` block. DeepSeek-V3
writes its calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each as
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`` (calls
separated by a newline), after the turn's text. A parser is chosen by family name
(``agent.parser: qwen3``), by the dotted path of a :class:`ToolCallParser` subclass, or detected
from the chat template.

As in TRL, a turn whose tool-call markup cannot be read (invalid JSON, no ``name``, an unclosed
block) is a plain-text answer: it calls nothing and ends the row's tool loop.

Layer L1: the standard library only.
"""

from __future__ import annotations

import importlib
import json
import re
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

    @abstractmethod
    def parse(self, text: str) -> AssistantTurn:
        """Parse one turn; never raises on model output (unreadable markup → ``malformed``)."""


class HermesToolCallParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5, Qwen2.5-Coder, Hermes, ...)."""

    template_marker = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> AssistantTurn:
        reasoning, text = self._split_reasoning(text)
        calls: list[ToolCall] = []
        for body in self._block.findall(text):
            call = _read_call(body)
            if call is None:
                return AssistantTurn(text.strip(), [], reasoning, malformed=True)
            calls.append(call)
        content = self._block.sub("", text)
        if "<tool_call>" in content or "</tool_call>" in content:  # an unclosed or stray block
            return AssistantTurn(text.strip(), [], reasoning, malformed=True)
        return AssistantTurn(content.strip(), calls, reasoning)

    def _split_reasoning(self, text: str) -> tuple[str | None, str]:
        return None, text


class Qwen3ToolCallParser(HermesToolCallParser):
    """Hermes tool calls after an optional ``<think>...</think>`` block (Qwen3)."""

    template_marker = "<think>"

    def _split_reasoning(self, text: str) -> tuple[str | None, str]:
        return _split_think(text)


def _split_think(text: str) -> tuple[str | None, str]:
    """``(thinking, rest)`` around the first ``</think>`` (``None``: the turn has no thinking)."""
    if "</think>" not in text:
        return None, text
    thought, _, rest = text.partition("</think>")
    return thought.replace("<think>", "", 1).strip(), rest


class DeepSeekV3ToolCallParser(ToolCallParser):
    """DeepSeek-V3's ``<｜tool▁calls▁begin｜>`` section, after an optional thinking block (its
    generation prompt opens ``<think>``, so a turn may start with thinking up to ``</think>``)."""

    template_marker = "<｜tool▁calls▁begin｜>"
    _calls = re.compile(r"<｜tool▁calls▁begin｜>(.*?)<｜tool▁calls▁end｜>", re.DOTALL)
    _call = re.compile(
        r"<｜tool▁call▁begin｜>([^<\n]+)<｜tool▁sep｜>([^\n<]+)\n```(?:json)?[ \t]*\n(.*?)\n?```[ \t]*<｜tool▁call▁end｜>",
        re.DOTALL,
    )
    _markup = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")

    def parse(self, text: str) -> AssistantTurn:
        reasoning, text = _split_think(text)
        sections = self._calls.findall(text)
        content = self._calls.sub("", text)
        malformed = AssistantTurn(text.strip(), [], reasoning, malformed=True)
        if len(sections) > 1 or any(marker in content for marker in self._markup):  # unclosed or stray markup
            return malformed
        calls: list[ToolCall] = []
        for section in sections:
            if not section.strip() or self._call.sub("", section).strip():  # no call, or text between calls
                return malformed
            for kind, name, body in self._call.findall(section):
                arguments = _read_arguments(body)
                if arguments is None or not name.strip():
                    return malformed
                calls.append(ToolCall(name.strip(), arguments, kind.strip()))
        return AssistantTurn(content.strip(), calls, reasoning)


def _read_arguments(body: str) -> dict[str, Any] | None:
    """A call's JSON arguments (empty: none); ``None`` when they are not a JSON object."""
    if not body.strip():
        return {}
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    return arguments if isinstance(arguments, dict) else None


def _read_call(body: str) -> ToolCall | None:
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


#: Family name -> parser class. Qwen3 is listed first: its template has both markers.
PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen3": Qwen3ToolCallParser,
    "qwen2.5": HermesToolCallParser,
    "hermes": HermesToolCallParser,
    "deepseek-v3": DeepSeekV3ToolCallParser,
}


def detect_family(chat_template: str | None) -> str | None:
    """The parser family whose markers the chat template contains (``None``: unknown).

    >>> detect_family("... <tool_call> ... <think> ..."), detect_family("<tool_call>"), detect_family("x")
    ('qwen3', 'qwen2.5', None)
    >>> detect_family("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>")
    'deepseek-v3'
    """
    if chat_template and "<｜tool▁calls▁begin｜>" in chat_template and "<｜tool▁sep｜>" in chat_template:
        return "deepseek-v3"
    if not chat_template or "<tool_call>" not in chat_template:
        return None
    return "qwen3" if "<think>" in chat_template else "qwen2.5"


def get_parser(spec: "str | ToolCallParser | None", chat_template: str | None) -> ToolCallParser:
    """The parser for ``agent.parser``: an instance, a family name, a dotted class path, or
    ``None`` to detect the family from the chat template.

    Raises:
        ValueError: Unknown family or path, or no family detected, naming the choices.
    """
    if isinstance(spec, ToolCallParser):
        return spec
    if spec is None:
        family = detect_family(chat_template)
        if family is None:
            raise ValueError(
                "cannot tell which tool-call format this model writes: its chat template has no known tool-call "
                f"markup. Set data.agent.parser to one of {sorted(PARSERS)} or to the dotted path of a "
                "grpo_lightning.tools.ToolCallParser subclass."
            )
        return PARSERS[family]()
    if spec in PARSERS:
        return PARSERS[spec]()
    module_name, _, attribute = spec.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attribute) if module_name else None
    except (ImportError, AttributeError) as err:
        raise ValueError(f"data.agent.parser={spec!r} cannot be imported ({err}).") from err
    if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
        raise ValueError(
            f"data.agent.parser={spec!r} is neither a known family ({sorted(PARSERS)}) nor a ToolCallParser subclass."
        )
    return cls()


__all__ = [
    "PARSERS", "AssistantTurn", "DeepSeekV3ToolCallParser", "HermesToolCallParser", "Qwen3ToolCallParser", "ToolCall",
    "ToolCallParser", "detect_family", "get_parser",
]  # fmt: skip

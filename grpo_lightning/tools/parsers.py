"""Reading tool calls out of a generated assistant turn, one parser per model family.

Qwen2.5 and Qwen3 (Hermes format) write each call as ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``; Qwen3 may open the turn with a ``<think>...</think>`` block. DeepSeek-V3
writes its calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each as
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`` (calls
separated by a newline), after the turn's text. The other families (Qwen3.5/3.6 and Nemotron-3's
XML functions, GLM-4, Llama 3.1/3.2, GPT-OSS, LFM2) are in :mod:`.family_parsers`, Gemma 4 in
:mod:`.gemma4_calls`. A parser is chosen by family name
(``agent.parser: qwen3``), by the dotted path of a :class:`ToolCallParser` subclass, or detected
from the chat template.

As in TRL, a turn whose tool-call markup cannot be read (invalid JSON, no ``name``, an unclosed
block) is a plain-text answer: it calls nothing and ends the row's tool loop.

Layer L1: the standard library only.
"""

from __future__ import annotations

import importlib
import re

from grpo_lightning.tools.family_parsers import (
    GLM4ToolCallParser, GptOssToolCallParser, LFM2ToolCallParser, Llama3ToolCallParser, XMLFunctionToolCallParser,
)
from grpo_lightning.tools.gemma4_calls import Gemma4ToolCallParser
from grpo_lightning.tools.tool_calls import (
    AssistantTurn, ToolCall, ToolCallParser, read_arguments, read_call, split_think,
)


class HermesToolCallParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5, Qwen2.5-Coder, Hermes, ...)."""

    template_marker = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> AssistantTurn:
        reasoning, text = self._split_reasoning(text)
        calls: list[ToolCall] = []
        for body in self._block.findall(text):
            call = read_call(body)
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
        return split_think(text)


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
        reasoning, text = split_think(text)
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
                arguments = read_arguments(body)
                if arguments is None or not name.strip():
                    return malformed
                calls.append(ToolCall(name.strip(), arguments, kind.strip()))
        return AssistantTurn(content.strip(), calls, reasoning)


#: Family name -> parser class. Qwen3 is listed first: its template has both markers.
PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen3": Qwen3ToolCallParser,
    "qwen2.5": HermesToolCallParser,
    "hermes": HermesToolCallParser,
    "deepseek-v3": DeepSeekV3ToolCallParser,
    "qwen3.5": XMLFunctionToolCallParser,  # Qwen3.5/3.6, Nemotron-3, Qwen3-Coder
    "glm4": GLM4ToolCallParser,  # GLM-4.5/4.6/4.7 (MoE)
    "llama3": Llama3ToolCallParser,  # Llama 3.1/3.2
    "gpt-oss": GptOssToolCallParser,
    "lfm2": LFM2ToolCallParser,  # LFM2/LFM2.5
    "gemma4": Gemma4ToolCallParser,
}

# (family, markers that must all be in the template), tried in order: the more specific formats
# first (GLM-4 and the XML format also write <tool_call>, and so do Qwen3's and Qwen2.5's).
_DETECTION: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("deepseek-v3", ("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>")),
    ("gemma4", (Gemma4ToolCallParser.template_marker,)),
    ("gpt-oss", ("<|channel|>", "<|call|>")),
    ("lfm2", ("<|tool_call_start|>",)),
    ("glm4", ("<tool_call>", "<arg_key>")),
    ("qwen3.5", ("<tool_call>", "<function=", "<parameter=")),
    ("llama3", (Llama3ToolCallParser.template_marker,)),
    ("qwen3", ("<tool_call>", "<think>")),
    ("qwen2.5", ("<tool_call>",)),
)


def detect_family(chat_template: str | None) -> str | None:
    """The parser family whose markers the chat template contains (``None``: unknown).

    >>> detect_family("... <tool_call> ... <think> ..."), detect_family("<tool_call>"), detect_family("x")
    ('qwen3', 'qwen2.5', None)
    >>> detect_family("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>")
    'deepseek-v3'
    >>> detect_family("<think> <tool_call>\\n<function=f>\\n<parameter=x>"), detect_family("<tool_call>f<arg_key>")
    ('qwen3.5', 'glm4')
    """
    if not chat_template:
        return None
    return next((family for family, markers in _DETECTION if all(m in chat_template for m in markers)), None)


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
    "PARSERS", "AssistantTurn", "DeepSeekV3ToolCallParser", "GLM4ToolCallParser", "Gemma4ToolCallParser", "GptOssToolCallParser",
    "HermesToolCallParser", "LFM2ToolCallParser", "Llama3ToolCallParser", "Qwen3ToolCallParser", "ToolCall",
    "ToolCallParser", "XMLFunctionToolCallParser", "detect_family", "get_parser",
]  # fmt: skip

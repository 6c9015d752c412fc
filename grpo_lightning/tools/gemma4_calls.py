"""Gemma 4's tool calls: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, one block per call.

The arguments are Gemma's own object syntax, as its chat template's ``format_argument`` writes
them: keys unquoted, strings between ``<|"|>`` delimiters (so a string may hold any character,
quotes and commas included), booleans ``true``/``false``, numbers as written, nested objects
``{...}`` and lists ``[...]``. Optional thinking comes first as ``<|channel>thought\\n...<channel|>``.
The model ends a calling turn with ``<|tool_response>`` (a stop token: the tool results follow in
the same model turn), an answer with ``<turn|>``; neither is in the text parsed here.

Unreadable markup is a plain answer (``malformed``), never an exception.

Layer L1: the standard library only.
"""

from __future__ import annotations

import json
import re
from typing import Any

from grpo_lightning.tools.tool_calls import AssistantTurn, ToolCall, ToolCallParser

_QUOTE = '<|"|>'
_BLOCK = re.compile(r"<\|tool_call>call:([^{<\s]+)(.*?)<tool_call\|>", re.DOTALL)
_THOUGHT = re.compile(r"^\s*<\|channel>thought\n?(.*?)<channel\|>", re.DOTALL)
_BARE_END = re.compile(r"[,}\]]")
_WORDS = {"true": True, "false": False, "null": None, "None": None, "True": True, "False": False}


class _Malformed(ValueError):
    pass


def read_gemma_value(text: str, i: int = 0) -> tuple[Any, int]:
    """The value that starts at ``text[i]`` and the index after it.

    >>> read_gemma_value('{a:1,b:<|"|>x, "y"<|"|>,c:[true,2.5,{d:<|"|><|"|>}]}')[0]
    {'a': 1, 'b': 'x, "y"', 'c': [True, 2.5, {'d': ''}]}
    """
    i = _skip_space(text, i)
    if text.startswith(_QUOTE, i):
        end = text.find(_QUOTE, i + len(_QUOTE))
        if end < 0:
            raise _Malformed("unclosed string")
        return text[i + len(_QUOTE) : end], end + len(_QUOTE)
    if text.startswith("{", i):
        return _read_items(text, i + 1, "}", keyed=True)
    if text.startswith("[", i):
        return _read_items(text, i + 1, "]", keyed=False)
    match = _BARE_END.search(text, i)
    end = match.start() if match else len(text)
    word = text[i:end].strip()
    if not word:
        raise _Malformed("empty value")
    if word in _WORDS:
        return _WORDS[word], end
    try:
        return json.loads(word), end  # a number
    except ValueError:
        return word, end  # a bare word: the template writes other scalars as they print


def _read_items(text: str, i: int, close: str, keyed: bool) -> tuple[Any, int]:
    items: dict[str, Any] | list[Any] = {} if keyed else []
    i = _skip_space(text, i)
    if text.startswith(close, i):
        return items, i + 1
    while True:
        if keyed:
            key, i = _read_key(text, i)
            value, i = read_gemma_value(text, i)
            items[key] = value  # type: ignore[index]
        else:
            value, i = read_gemma_value(text, i)
            items.append(value)  # type: ignore[union-attr]
        i = _skip_space(text, i)
        if text.startswith(",", i):
            i += 1
        elif text.startswith(close, i):
            return items, i + 1
        else:
            raise _Malformed(f"expected ',' or {close!r} at {i}")


def _read_key(text: str, i: int) -> tuple[str, int]:
    i = _skip_space(text, i)
    if text.startswith(_QUOTE, i):  # nested keys may be quoted (escape_keys)
        key, i = read_gemma_value(text, i)
    else:
        colon = text.find(":", i)
        if colon < 0:
            raise _Malformed("a key without ':'")
        key, i = text[i:colon].strip(), colon
    i = _skip_space(text, i)
    if not key or not text.startswith(":", i):
        raise _Malformed("a key without ':'")
    return str(key), i + 1


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class Gemma4ToolCallParser(ToolCallParser):
    """Gemma 4 (see the module docstring).

    >>> turn = Gemma4ToolCallParser().parse(
    ...     '<|channel>thought\\nAdd them.<channel|><|tool_call>call:add{a:1,b:<|"|>x y<|"|>}<tool_call|>')
    >>> turn.reasoning_content, turn.tool_calls
    ('Add them.', [ToolCall(name='add', arguments={'a': 1, 'b': 'x y'}, type='function')])
    """

    template_marker = "<|tool_call>call:"

    def parse(self, text: str) -> AssistantTurn:
        reasoning = None
        if (thought := _THOUGHT.match(text)) is not None:
            reasoning, text = thought.group(1).strip(), text[thought.end() :]
        calls: list[ToolCall] = []
        for name, body in _BLOCK.findall(text):
            try:
                arguments, end = read_gemma_value(body)
            except _Malformed:
                arguments, end = None, 0
            if not isinstance(arguments, dict) or body[end:].strip():
                return AssistantTurn(text.strip(), [], reasoning, malformed=True)
            calls.append(ToolCall(name, arguments))
        content = _BLOCK.sub("", text)
        if "<|tool_call>" in content or "<tool_call|>" in content:  # an unclosed or stray block
            return AssistantTurn(text.strip(), [], reasoning, malformed=True)
        return AssistantTurn(content.strip(), calls, reasoning)


__all__ = ["Gemma4ToolCallParser", "read_gemma_value"]

"""Tool-call parsers of the families whose markup is not Hermes JSON (TRL's known response formats).

* **XML functions** (Qwen3.5/3.6, Nemotron-3, Qwen3-Coder): ``<tool_call>\\n<function=NAME>\\n
  <parameter=KEY>\\nVALUE\\n</parameter>...\\n</function>\\n</tool_call>``, after optional
  thinking up to ``</think>``.
* **GLM-4** (GLM-4.5/4.6/4.7 MoE): ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE
  </arg_value>...</tool_call>``, after optional thinking.
* **Llama 3.1/3.2**: the whole turn is one JSON object ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``); one call per turn, no text beside it.
* **GPT-OSS** (harmony): messages ``<|channel|>CHANNEL<|message|>TEXT`` separated by
  ``<|end|><|start|>assistant``; the ``analysis`` channel is the reasoning, ``final`` the answer,
  and a message addressed ``to=functions.NAME`` (in its header or after its channel) is a call
  whose text is the JSON arguments.
* **LFM2/LFM2.5**: ``<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>``, Python
  call syntax with literal arguments.

XML and GLM values are JSON when they parse as JSON (``1`` → 1, ``true`` → True), else the
string itself, as TRL reads them; ``True``/``False``/``None`` (how those templates render Python's
values) read back as the values. Unreadable markup is a plain answer (``malformed``), never an
exception.

Layer L1: the standard library only.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from grpo_lightning.tools.tool_calls import AssistantTurn, ToolCall, ToolCallParser, read_arguments, split_think

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


_PYTHON_WORDS = {"True": True, "False": False, "None": None}


def _json_or_text(value: str) -> Any:
    """``value`` as JSON when it is JSON, else the string (TRL's ``allow_non_json``); the words
    ``True``/``False``/``None`` are what the XML templates render Python's values as (``| string``),
    so they read back as those values (TRL keeps the strings: a ``False`` string is truthy).

    >>> _json_or_text("3"), _json_or_text("x y"), _json_or_text("False"), _json_or_text('{"a": [1]}')
    (3, 'x y', False, {'a': [1]})
    """
    try:
        return json.loads(value)
    except ValueError:
        return _PYTHON_WORDS.get(value.strip(), value)


class _BlockParser(ToolCallParser):
    """``<tool_call>...</tool_call>`` blocks after optional thinking; :meth:`_read` reads one block."""

    def parse(self, text: str) -> AssistantTurn:
        reasoning, text = split_think(text)
        calls: list[ToolCall] = []
        for body in _TOOL_CALL_BLOCK.findall(text):
            call = self._read(body)
            if call is None:
                return AssistantTurn(text.strip(), [], reasoning, malformed=True)
            calls.append(call)
        content = _TOOL_CALL_BLOCK.sub("", text)
        if "<tool_call>" in content or "</tool_call>" in content:  # an unclosed or stray block
            return AssistantTurn(text.strip(), [], reasoning, malformed=True)
        return AssistantTurn(content.strip(), calls, reasoning)

    def _read(self, body: str) -> ToolCall | None:
        raise NotImplementedError


class XMLFunctionToolCallParser(_BlockParser):
    """Qwen3.5/3.6, Nemotron-3, Qwen3-Coder: ``<function=NAME>`` with ``<parameter=KEY>`` values.

    >>> XMLFunctionToolCallParser().parse(
    ...     "ok</think>\\n\\n<tool_call>\\n<function=add>\\n<parameter=a>\\n1\\n</parameter>\\n"
    ...     "<parameter=b>\\nx y\\n</parameter>\\n</function>\\n</tool_call>").message()["tool_calls"]
    [{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1, 'b': 'x y'}}}]
    """

    template_marker = "<function="
    _function = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def _read(self, body: str) -> ToolCall | None:
        match = self._function.match(body)
        if match is None or not match.group(1).strip():
            return None
        inner = match.group(2)
        if self._parameter.sub("", inner).strip():  # text outside the parameters
            return None
        arguments = {key.strip(): _json_or_text(value) for key, value in self._parameter.findall(inner)}
        return ToolCall(match.group(1).strip(), arguments)


class GLM4ToolCallParser(_BlockParser):
    """GLM-4.5/4.6/4.7: the name on the block's first line, then ``<arg_key>``/``<arg_value>`` pairs.

    >>> GLM4ToolCallParser().parse("<tool_call>add\\n<arg_key>a</arg_key>\\n<arg_value>1</arg_value>\\n"
    ...                            "</tool_call>").tool_calls
    [ToolCall(name='add', arguments={'a': 1}, type='function')]
    """

    template_marker = "<arg_key>"
    _pair = re.compile(r"<arg_key>([^<]+)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _read(self, body: str) -> ToolCall | None:
        name, _, rest = body.strip().partition("\n")
        if not name.strip() or "<" in name or self._pair.sub("", rest).strip():
            return None
        return ToolCall(name.strip(), {key.strip(): _json_or_text(value) for key, value in self._pair.findall(rest)})


class Llama3ToolCallParser(ToolCallParser):
    """Llama 3.1/3.2: a turn that is one ``{"name": ..., "parameters": {...}}`` object is a call.

    >>> Llama3ToolCallParser().parse('{"name": "add", "parameters": {"a": 1}}').tool_calls
    [ToolCall(name='add', arguments={'a': 1}, type='function')]
    >>> Llama3ToolCallParser().parse("It is 3.").content
    'It is 3.'
    """

    template_marker = '"parameters": dictionary of argument name'
    max_calls_per_turn = 1

    def parse(self, text: str) -> AssistantTurn:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return AssistantTurn(text.strip())
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
            return AssistantTurn(text.strip(), malformed=True)
        arguments = payload.get("parameters", payload.get("arguments", {}))
        if isinstance(arguments, str):
            arguments = read_arguments(arguments)
        if not isinstance(arguments, dict):
            return AssistantTurn(text.strip(), malformed=True)
        return AssistantTurn("", [ToolCall(payload["name"], arguments)])


class GptOssToolCallParser(ToolCallParser):
    """GPT-OSS's harmony messages (the turn starts after the generation prompt ``<|start|>assistant``).

    >>> turn = GptOssToolCallParser().parse("<|channel|>analysis<|message|>Need add.<|end|><|start|>assistant"
    ...     "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{\\"a\\": 1}")
    >>> turn.reasoning_content, turn.tool_calls
    ('Need add.', [ToolCall(name='add', arguments={'a': 1}, type='function')])
    """

    template_marker = "<|channel|>"
    _message = re.compile(
        r"(?:to=(?P<before>\S+?)\s*)?<\|channel\|>(?P<channel>[a-z]+)(?:\s+to=(?P<after>[^\s<]+))?"
        r"\s*(?:<\|constrain\|>)?\s*(?:json)?\s*<\|message\|>(?P<text>.*?)(?=<\|end\|>|<\|call\|>|<\|return\|>|$)",
        re.DOTALL,
    )

    def parse(self, text: str) -> AssistantTurn:
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        end = 0
        for match in self._message.finditer(text):
            between = text[end : match.start()]
            if re.sub(r"<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>assistant|\s", "", between):
                return AssistantTurn(text.strip(), malformed=True)  # text outside the messages
            end = match.end()
            recipient = match.group("before") or match.group("after")
            body = match.group("text")
            if recipient is not None:
                arguments = read_arguments(body)
                if not recipient.startswith("functions.") or arguments is None:
                    return AssistantTurn(text.strip(), [], "\n".join(reasoning) or None, malformed=True)
                calls.append(ToolCall(recipient.removeprefix("functions."), arguments))
            elif match.group("channel") == "analysis":
                reasoning.append(body.strip())
            else:
                content.append(body.strip())
        if end == 0:
            return AssistantTurn(text.strip())  # no harmony markup: a plain answer
        if re.sub(r"<\|end\|>|<\|call\|>|<\|return\|>|\s", "", text[end:]):
            return AssistantTurn(text.strip(), malformed=True)
        return AssistantTurn("\n".join(content), calls, "\n".join(reasoning) if reasoning else None)


class LFM2ToolCallParser(ToolCallParser):
    """LFM2/LFM2.5: a Python list of calls with literal arguments between the call markers.

    >>> LFM2ToolCallParser().parse("<|tool_call_start|>[add(a=1, b='x y')]<|tool_call_end|>").tool_calls
    [ToolCall(name='add', arguments={'a': 1, 'b': 'x y'}, type='function')]
    """

    template_marker = "<|tool_call_start|>"
    _section = re.compile(r"<\|tool_call_start\|>(.*?)<\|tool_call_end\|>", re.DOTALL)

    def parse(self, text: str) -> AssistantTurn:
        calls: list[ToolCall] = []
        for body in self._section.findall(text):
            read = self._read(body)
            if read is None:
                return AssistantTurn(text.strip(), malformed=True)
            calls.extend(read)
        content = self._section.sub("", text)
        if "<|tool_call_start|>" in content or "<|tool_call_end|>" in content:
            return AssistantTurn(text.strip(), malformed=True)
        return AssistantTurn(content.strip(), calls)

    @staticmethod
    def _read(body: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(body.strip(), mode="eval").body
        except SyntaxError:
            return None
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for node in nodes:
            if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)) or node.args:
                return None
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return None
            if len(arguments) != len(node.keywords):  # a **kwargs splat
                return None
            calls.append(ToolCall(ast.unparse(node.func), arguments))
        return calls


__all__ = [
    "GLM4ToolCallParser", "GptOssToolCallParser", "LFM2ToolCallParser", "Llama3ToolCallParser",
    "XMLFunctionToolCallParser",
]

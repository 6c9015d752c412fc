"""Tool calls read out of Qwen2.5 / Qwen3 turns; unreadable markup is a plain answer (TRL)."""

from __future__ import annotations

import pytest

from grpo_lightning.tools import (
    HermesToolCallParser, Qwen3ToolCallParser, ToolCall, ToolCallParser, detect_family, get_parser,
)

HERMES = HermesToolCallParser()


def test_one_call_and_text():
    turn = HERMES.parse('Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    assert turn.content == "Let me compute."
    assert turn.tool_calls == [ToolCall("multiply", {"a": 3, "b": 4})]
    assert turn.message() == {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]}


def test_several_calls_in_order_and_argument_forms():
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
            '<tool_call>{"name": "c"}</tool_call><tool_call>{"name": "d", "arguments": null}</tool_call>')
    turn = HERMES.parse(text)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("a", {"x": 1}), ("b", {"y": 2}), ("c", {}), ("d", {})]
    assert turn.content == "" and not turn.malformed


def test_plain_answer():
    turn = HERMES.parse("The answer is 12.")
    assert turn.tool_calls == [] and turn.content == "The answer is 12." and not turn.malformed
    assert "tool_calls" not in turn.message()


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 3,\n</tool_call>',  # invalid JSON
    '<tool_call>\n{"arguments": {"a": 3}}\n</tool_call>',  # no name
    '<tool_call>\n["multiply"]\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "m", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "m", "arguments": {}}',  # never closed
    '<tool_call>{"name": "ok", "arguments": {}}</tool_call><tool_call>{bad}</tool_call>',  # one bad block spoils the turn
])
def test_malformed_markup_calls_nothing(text):
    turn = HERMES.parse(text)
    assert turn.malformed and turn.tool_calls == [] and turn.content == text.strip()


def test_qwen3_thinking_is_split_off():
    turn = Qwen3ToolCallParser().parse('<think>\nI need 3*4.\n</think>\n\n<tool_call>\n{"name": "m", "arguments": {}}\n</tool_call>')
    assert turn.reasoning_content == "I need 3*4." and turn.content == "" and turn.tool_calls == [ToolCall("m", {})]
    assert Qwen3ToolCallParser().parse("12").reasoning_content is None


def test_family_detected_from_the_real_templates(qwen):
    family, tokenizer = qwen
    assert detect_family(tokenizer.chat_template) == family
    assert type(get_parser(None, tokenizer.chat_template)) is {"qwen2.5": HermesToolCallParser, "qwen3": Qwen3ToolCallParser}[family]


class MyParser(ToolCallParser):
    def parse(self, text):
        return HERMES.parse(text.replace("CALL", "<tool_call>").replace("END", "</tool_call>"))


def test_parser_by_name_path_or_instance_and_errors():
    assert type(get_parser("qwen2.5", None)) is HermesToolCallParser
    mine = get_parser(f"{__name__}.MyParser", None)
    assert mine.parse('CALL{"name": "x"}END').tool_calls == [ToolCall("x", {})]
    assert get_parser(mine, None) is mine
    with pytest.raises(ValueError, match="data.agent.parser"):
        get_parser(None, "{{ messages }}")  # no known markup
    with pytest.raises(ValueError, match="neither a known family"):
        get_parser("collections.OrderedDict", None)

"""Chat templates with the real Qwen tokenizers: tool schemas in the prompt, the ids of a tool
turn, the prefix-preserving check, Qwen3's fixed training template, and the refusal."""

from __future__ import annotations

import json

import pytest

from grpo_lightning.tools import TemplateError, Toolbox, ToolTurnTemplate, training_chat_template
from tests.tools.test_schema import multiply


def test_schemas_rendered_in_the_prompt(qwen):
    family, tokenizer = qwen
    template = training_chat_template(tokenizer, [tokenizer.eos_token_id], {"enable_thinking": False})
    schemas = Toolbox.of([multiply]).schemas
    text = tokenizer.decode(template.render([{"role": "user", "content": "3 times 4?"}], schemas))
    assert json.dumps(schemas[0]) in text  # the schema JSON, as the template writes it
    assert template.lists_tools(schemas)  # the start-up check that the model is told about its tools
    assert "<tool_call>" in text and text.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if family == "qwen3" else ""))


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_tool_turn_ids(qwen, kwargs):
    family, tokenizer = qwen
    template = training_chat_template(tokenizer, [tokenizer.eos_token_id], kwargs)
    assert (template.chat_template is not None) == (family == "qwen3")  # Qwen3 needs the fixed template
    ids = template.tool_turn_ids([{"role": "tool", "name": "multiply", "content": "12"},
                                  {"role": "tool", "name": "multiply", "content": "30"}], ["multiply", "multiply"])
    think = "<think>\n\n</think>\n\n" if family == "qwen3" and kwargs else ""
    expected = ("\n<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\n30\n</tool_response>"
                f"<|im_end|>\n<|im_start|>assistant\n{think}")
    assert tokenizer.decode(ids) == expected
    assert ids == tokenizer(expected)["input_ids"]  # special tokens are single ids


def test_qwen3_own_template_is_not_prefix_preserving(shared_assets):
    from tests.tools.tokenizers import load_qwen

    tokenizer = load_qwen(shared_assets, "qwen3")
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        ToolTurnTemplate(tokenizer, [tokenizer.eos_token_id], {"enable_thinking": False}).check()


def test_unknown_template_that_rewrites_history_is_refused(shared_assets):
    from tests.tools.tokenizers import load_qwen

    tokenizer = load_qwen(shared_assets, "qwen2.5")
    # Renders earlier turns differently once a later message follows (like Qwen3), but matches no known fix.
    rewriting = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}LAST{% endif %}"
                 "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="Known fixes exist for: qwen3"):
        training_chat_template(tokenizer, [tokenizer.eos_token_id], chat_template=rewriting)
    clone = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    clone.chat_template = rewriting
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        training_chat_template(clone, [clone.eos_token_id])

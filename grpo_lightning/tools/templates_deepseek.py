"""DeepSeek-V3: detecting its chat template and our fixed, prefix-preserving training template.

DeepSeek-V3's own template renders a tool exchange as::

    <｜User｜>question<｜Assistant｜>text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {args}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>
    result<｜tool▁output▁end｜><｜tool▁outputs▁end｜>answer<｜end▁of▁sentence｜>

(after the tool outputs the model writes on directly, with no new turn marker). It cannot drive a
token-in, token-out tool loop as it is:

* it concatenates ``arguments`` as a string, so a call in the chat-template format (arguments as
  a mapping, as our parsers and tool loop write them) fails to render;
* ``<｜tool▁outputs▁end｜>`` is written only when the conversation *ends* on tool messages (or a
  plain answer follows), so appending a tool-calling assistant turn (or a user turn) after tool
  results removes a token that was already rendered;
* the "first call" and "first output" flags are never reset, so the second round of calls loses
  ``<｜Assistant｜><｜tool▁calls▁begin｜>`` and the second round of results loses
  ``<｜tool▁outputs▁begin｜>``: round two renders differently from round one.

The fixed template below (written for this project from the model's template) changes exactly
those: arguments that are not a string are written with ``tojson``; a non-tool message after tool
results first closes them with ``<｜tool▁outputs▁end｜>``; every tool-calling assistant message opens
its own ``<｜tool▁calls▁begin｜>`` (with ``<｜Assistant｜>`` unless it follows tool results, which
already end with ``<｜tool▁outputs▁end｜>``); every run of tool messages opens its own
``<｜tool▁outputs▁begin｜>``. Prompts (system and user messages, plain assistant turns, the
generation prompt ``<｜Assistant｜><think>\\n``) render exactly as in the model's template, which,
like it, does not describe ``tools`` (put their descriptions in the system prompt).

Layer L1: strings only.
"""

from __future__ import annotations

#: Markers of DeepSeek-V3's template: its tool-call layout (``function<｜tool▁sep｜>NAME`` + a json fence).
DEEPSEEK_V3_MARKERS = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>",
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json'",
    "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>",
)


def is_deepseek_v3(template: str | None) -> bool:
    """Whether a chat template is DeepSeek-V3's own (its tool-call and tool-output markup); our
    training template is not (it needs no fix).

    >>> is_deepseek_v3(DEEPSEEK_V3_TRAINING_TEMPLATE), is_deepseek_v3("<tool_call>")
    (False, False)
    """
    return bool(template) and all(marker in template for marker in DEEPSEEK_V3_MARKERS)  # type: ignore[operator]


_CALL = (
    "'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n```json\\n' "
    "+ (tool['function']['arguments'] if tool['function']['arguments'] is string "
    "else tool['function']['arguments'] | tojson) + '\\n```<｜tool▁call▁end｜>'"
)

#: Our DeepSeek-V3 training template (one line per statement; ``{%- -%}`` strips the newlines).
DEEPSEEK_V3_TRAINING_TEMPLATE = "\n".join([
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = false -%}{%- endif -%}",
    "{%- set ns = namespace(is_tool=false, system_prompt='', is_first_sp=true) -%}",
    "{%- for message in messages -%}",
    "{%- if message['role'] == 'system' -%}",
    "{%- if ns.is_first_sp -%}{%- set ns.system_prompt = ns.system_prompt + message['content'] -%}"
    "{%- set ns.is_first_sp = false -%}",
    "{%- else -%}{%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] -%}{%- endif -%}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{{- bos_token -}}{{- ns.system_prompt -}}",
    "{%- for message in messages -%}",
    # Tool results close before any other message (the model's template drops this token).
    "{%- if ns.is_tool and message['role'] in ['user', 'assistant'] -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}",
    "{%- if message['role'] == 'user' -%}",
    "{{- '<｜User｜>' + message['content'] -}}",
    "{%- elif message['role'] == 'assistant' and 'tool_calls' in message -%}",
    "{%- if not ns.is_tool -%}{{- '<｜Assistant｜>' -}}{%- endif -%}",
    "{%- if message['content'] is not none -%}{{- message['content'] -}}{%- endif -%}",
    "{{- '<｜tool▁calls▁begin｜>' -}}",
    "{%- for tool in message['tool_calls'] -%}",
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}",
    "{{- " + _CALL + " -}}",
    "{%- endfor -%}",
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' -}}",
    "{%- elif message['role'] == 'assistant' -%}",
    "{%- if ns.is_tool -%}{{- message['content'] + '<｜end▁of▁sentence｜>' -}}",
    "{%- else -%}{%- set content = message['content'] -%}",
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}",
    "{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' -}}",
    "{%- endif -%}",
    "{%- elif message['role'] == 'tool' -%}",
    "{%- if not ns.is_tool -%}{{- '<｜tool▁outputs▁begin｜>' -}}{%- endif -%}",
    "{{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' -}}",
    "{%- endif -%}",
    "{%- if message['role'] != 'system' -%}{%- set ns.is_tool = message['role'] == 'tool' -%}{%- endif -%}",
    "{%- endfor -%}",
    "{%- if ns.is_tool -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}",
    "{%- if add_generation_prompt and not ns.is_tool -%}{{- '<｜Assistant｜><think>\\n' -}}{%- endif -%}",
])  # fmt: skip


def fix_deepseek_v3(template: str) -> str | None:
    """DeepSeek-V3's template -> our training template (``None``: not DeepSeek-V3's)."""
    return DEEPSEEK_V3_TRAINING_TEMPLATE if is_deepseek_v3(template) else None


__all__ = ["DEEPSEEK_V3_MARKERS", "DEEPSEEK_V3_TRAINING_TEMPLATE", "fix_deepseek_v3", "is_deepseek_v3"]

"""The tool-call families beyond Hermes JSON, against the real chat templates TRL ships (installed
with the dev extra, read from the ``trl`` package, never copied here): the family is detected from
each template, an assistant turn with tool calls rendered by the template parses back to the same
calls (names, typed arguments, reasoning), plain answers and broken markup are told apart, and
the start-up template check passes or refuses each template as documented in docs/agents.md.

The tokenizer is the Qwen2.5 asset with each family's special tokens added (so its end-of-turn
markers are single ids, as in the family's own tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_lightning.tools import ToolTurnTemplate, detect_family, get_parser
from grpo_lightning.tools.templates import TemplateError

trl = pytest.importorskip("trl", reason="the real chat templates come from the trl package (dev extra)")
TEMPLATES = Path(trl.__file__).parent / "chat_templates"

GEMMA4_SPECIALS = ["<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                   "<tool_response|>", "<|tool>", "<tool|>", "<|channel>", "<channel|>", '<|"|>']
# template file[/no-thinking]: (family, special tokens, end-of-turn tokens, prefix-preserving as the
# model ships it); "/no-thinking" renders with chat_template_kwargs {"enable_thinking": False}.
FAMILIES = {
    "qwen3_5_nothink": ("qwen3.5", ["<think>", "</think>", "<tool_call>", "</tool_call>"], ["<|im_end|>"], True),
    "qwen3_5_think": ("qwen3.5", ["<think>", "</think>", "<tool_call>", "</tool_call>"], ["<|im_end|>"], True),
    "qwen3_6": ("qwen3.5", ["<think>", "</think>", "<tool_call>", "</tool_call>"], ["<|im_end|>"], True),
    "nemotron_3_nano": ("qwen3.5", ["<think>", "</think>", "<tool_call>", "</tool_call>"], ["<|im_end|>"], True),
    "nemotron_3_nano/no-thinking": ("qwen3.5", ["<think>", "</think>", "<tool_call>", "</tool_call>"], ["<|im_end|>"],
                                    True),
    "glm4moe": ("glm4", ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                         "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                         "</arg_value>"], ["<|observation|>", "<|user|>"], True),
    "llama3_1": ("llama3", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                            "<|eom_id|>", "<|python_tag|>"], ["<|eot_id|>", "<|eom_id|>"], True),
    "llama3_2": ("llama3", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                            "<|eom_id|>", "<|python_tag|>"], ["<|eot_id|>", "<|eom_id|>"], True),
    "gptoss": ("gpt-oss", ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
                           "<|constrain|>"], ["<|call|>", "<|return|>", "<|end|>"], True),
    # Gemma 4 ends a calling turn with <|tool_response> (the results follow in the same model turn),
    # but for its v2 template, which closes the call turn (<turn|>) and opens a tool turn.
    **{name: ("gemma4", GEMMA4_SPECIALS, ["<|tool_response>", "<turn|>"], True)
       for name in ("gemma4", "gemma4_v3", "gemma4_v4", "gemma4_v5")},
    "gemma4_v2": ("gemma4", GEMMA4_SPECIALS, ["<turn|>", "<|tool_response>"], True),
    "lfm2_2_5": ("lfm2", ["<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
                          "<|tool_response_start|>", "<|tool_response_end|>"], ["<|im_end|>"], True),
}
CALLS = [("add", {"a": 1, "b": "x y"}), ("lookup", {"query": "weather in Paris", "days": 3, "metric": True})]
USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def base_tokenizer_dir(shared_assets):
    folder = shared_assets / "tokenizers" / "qwen2.5"
    if not folder.is_dir():
        pytest.skip(f"the Qwen2.5 tokenizer asset is missing at {folder}")
    return folder


def _family(name, base_tokenizer_dir):
    from transformers import AutoTokenizer

    family, specials, ends, prefix_preserving = FAMILIES[name]
    tokenizer = AutoTokenizer.from_pretrained(str(base_tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    file, _, variant = name.partition("/")
    template = (TEMPLATES / f"{file}.jinja").read_text(encoding="utf-8")
    kwargs = {"enable_thinking": False} if variant == "no-thinking" else {}
    return family, tokenizer, template, ends, prefix_preserving, kwargs


def _generated_text(tokenizer, template, assistant, ends, kwargs=None):
    """What the model generated for ``assistant`` as the template renders it: the rendering after
    the generation prompt, without the end-of-turn marker."""
    kwargs = kwargs or {}
    prompt = tokenizer.apply_chat_template([USER], add_generation_prompt=True, tokenize=False, chat_template=template,
                                           **kwargs)
    full = tokenizer.apply_chat_template([USER, assistant], tokenize=False, chat_template=template, **kwargs)
    shared = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), len(prompt))
    # A generation prompt that opens thinking ("<think>\n") renders as an empty block in a past turn.
    assert prompt[shared:] in ("", "\n"), f"the assistant turn does not follow the generation prompt: {prompt[shared:]!r}"
    text = full[shared:].rstrip()  # whitespace the template puts after the turn's end marker
    for end in ends:
        if text.endswith(end):
            return text.removesuffix(end)  # what precedes the marker, "\n" included, is generated
    return text


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_rendered_tool_calls_parse_back(name, base_tokenizer_dir):
    family, tokenizer, template, ends, _, kwargs = _family(name, base_tokenizer_dir)
    assert detect_family(template) == family
    parser = get_parser(None, template)
    calls = CALLS[: parser.max_calls_per_turn or len(CALLS)]
    if family == "gpt-oss":
        calls = CALLS[:1]  # harmony: a turn ends at its call (<|call|>)
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    turn = parser.parse(_generated_text(tokenizer, template, assistant, ends, kwargs))
    assert not turn.malformed
    assert [(c.name, c.arguments) for c in turn.tool_calls] == calls
    plain = parser.parse(_generated_text(tokenizer, template, {"role": "assistant", "content": "It is 3."}, ends,
                                         kwargs))
    assert plain.tool_calls == [] and not plain.malformed and "It is 3." in plain.content


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_start_up_check_of_each_template(name, base_tokenizer_dir):
    """The templates that are prefix-preserving as shipped drive the tool loop as they are; the
    others are refused at start-up naming the fix (data.agent.chat_template)."""
    family, tokenizer, template, ends, prefix_preserving, kwargs = _family(name, base_tokenizer_dir)
    check = ToolTurnTemplate(tokenizer, [tokenizer.convert_tokens_to_ids(t) for t in ends], kwargs,
                             chat_template=template, max_calls_per_turn=get_parser(family, None).max_calls_per_turn)
    if prefix_preserving:
        check.check()
    else:
        with pytest.raises(TemplateError, match="not prefix-preserving.*data.agent.chat_template"):
            check.check()


@pytest.mark.parametrize("family, text", [
    ("qwen3.5", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>"),  # no </function>
    ("qwen3.5", "<tool_call>\n<function=add>\nstray\n</function>\n</tool_call>"),
    ("qwen3.5", "<tool_call>\n<function=add>\n</function>\n"),  # unclosed block
    ("glm4", "<tool_call>add\n<arg_key>a</arg_key>\n</tool_call>"),  # a key without a value
    ("glm4", "<tool_call>\n</tool_call>"),  # no name
    ("llama3", '{"name": "add", "parameters": {"a": 1}'),  # broken JSON
    ("llama3", '{"parameters": {"a": 1}}'),  # no name
    ("gpt-oss", '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1'),
    ("gpt-oss", '<|channel|>commentary to=browser.search<|message|>{"q": "x"}'),  # not a function
    ("lfm2", "<|tool_call_start|>[add(a=1, b=open('x'))]<|tool_call_end|>"),  # not a literal
    ("lfm2", "<|tool_call_start|>[add(1, 2)]<|tool_call_end|>"),  # positional arguments
    ("lfm2", "<|tool_call_start|>[add(a=1)]"),
    ("gemma4", '<|tool_call>call:add{a:<|"|>unclosed}<tool_call|>'),  # a string without its closing delimiter
    ("gemma4", "<|tool_call>call:add{a:1,b}<tool_call|>"),  # a key without a value
    ("gemma4", "<|tool_call>call:add{a:1}"),  # unclosed block
    ("gemma4", "<|tool_call>call:add[1, 2]<tool_call|>"),  # arguments not an object
])
def test_unreadable_markup_is_a_plain_answer(family, text):
    turn = get_parser(family, None).parse(text)
    assert turn.malformed and turn.tool_calls == []


def test_gemma4_strings_hold_any_character_and_thinking_comes_first():
    turn = get_parser("gemma4", None).parse(
        '<|channel>thought\nQuote it.<channel|>Sure.<|tool_call>call:say{text:<|"|>a, "b" {c}: [d]<|"|>,n:-2.5e3,'
        'flags:[true,false],nested:{<|"|>k<|"|>:null}}<tool_call|>')
    assert turn.reasoning_content == "Quote it." and turn.content == "Sure." and not turn.malformed
    assert turn.tool_calls[0].arguments == {"text": 'a, "b" {c}: [d]', "n": -2500.0, "flags": [True, False],
                                            "nested": {"k": None}}


def test_reasoning_and_answer_channels():
    gpt_oss = get_parser("gpt-oss", None).parse(
        "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>It is 3.")
    assert (gpt_oss.reasoning_content, gpt_oss.content, gpt_oss.tool_calls) == ("Simple.", "It is 3.", [])
    header_recipient = get_parser("gpt-oss", None).parse(
        ' to=functions.add<|channel|>commentary json<|message|>{"a": 2}')  # the template's own placement
    assert [(c.name, c.arguments) for c in header_recipient.tool_calls] == [("add", {"a": 2})]
    xml = get_parser("qwen3.5", None).parse("Let me add.\n</think>\n\nSure.\n<tool_call>\n<function=add>\n"
                                            "<parameter=a>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")
    assert (xml.reasoning_content, xml.content, xml.tool_calls[0].arguments) == ("Let me add.", "Sure.", {"a": [1, 2]})
    glm = get_parser("glm4", None).parse("<think>Add.</think>\n<tool_call>add\n<arg_key>s</arg_key>\n"
                                         "<arg_value>not json {</arg_value>\n</tool_call>")
    assert (glm.reasoning_content, glm.tool_calls[0].arguments) == ("Add.", {"s": "not json {"})


def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return f"sum={a + b}"


@pytest.mark.parametrize("name", sorted(n for n, spec in FAMILIES.items() if spec[3]))
def test_a_tool_loop_runs_with_each_shipped_prefix_preserving_template(name, base_tokenizer_dir):
    """A scripted policy writes the call exactly as the family's template renders one (what the
    model was trained on), the loop runs the tool, appends the template's tool turn and generates
    the answer: one call, its result in the completion, out of the loss."""
    from grpo_lightning.agents import AgentSampler, Episode
    from grpo_lightning.tools import Toolbox
    from grpo_lightning.types import GenerationParams
    from tests.agents.scripted import Handle, ScriptedSampler

    family, tokenizer, template, ends, _, kwargs = _family(name, base_tokenizer_dir)
    tokenizer.eos_token = ends[0]  # the scripted turns end with it
    thinking = ToolTurnTemplate(tokenizer, [], kwargs, chat_template=template).opens_thinking()
    # A generation prompt that opens <think> is followed by the model's reasoning, then the call.
    call_turn = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 40, "b": 2}}}],
        **({"reasoning_content": "I add them."} if thinking else {})}
    call_text = _generated_text(tokenizer, template, call_turn, ends, kwargs)
    answer = "<|channel|>final<|message|>It is 42." if family == "gpt-oss" else "It is 42."

    def script(context, k):
        return answer if "sum=42" in context else call_text

    tools = Toolbox.of([add])
    sampler = AgentSampler(ScriptedSampler(script), tools, chat_template=template, chat_template_kwargs=kwargs)
    sampler.bind(Handle(tokenizer, eos_token_ids=tuple(tokenizer.convert_tokens_to_ids(t) for t in ends)))
    assert sampler.parser.__class__ is type(get_parser(family, None))
    prompt = sampler.render_prompt([{"role": "user", "content": "What is 40 + 2?"}], tools)
    (rollout,) = sampler.run([Episode(list(prompt), tools)], GenerationParams(max_completion_length=400), 1)
    assert rollout.extra["num_tool_calls"] == 1 and rollout.extra["num_tool_failures"] == 0
    text = tokenizer.decode(rollout.completion_ids)
    assert "sum=42" in text and text.rstrip().removesuffix(tokenizer.eos_token).endswith("It is 42.")
    tool_part = [i for i, m in enumerate(rollout.tool_mask) if m == 0]
    assert tool_part and "sum=42" in tokenizer.decode([rollout.completion_ids[i] for i in tool_part])
    # Token in, token out: up to the answer, the trained ids are the template's own rendering of the
    # conversation (its call turn as generated, its tool turn, the next generation prompt).
    messages = [{"role": "user", "content": "What is 40 + 2?"}, call_turn, {"role": "tool", "name": "add", "content": "sum=42"}]
    expected = tokenizer.decode(sampler.template.render(messages, tools=tools.schemas))
    assert tokenizer.decode(rollout.prompt_ids + rollout.completion_ids[: tool_part[-1] + 1]) == expected


@pytest.mark.parametrize("name", ["gemma4", "gemma4_v3", "gemma4_v4", "gemma4_v5"])
def test_gemma4_names_each_result_after_its_own_call(name, base_tokenizer_dir):
    """These templates find a result's call by ``tool_call_id`` (without ids every result takes the
    turn's last call's name): the tool turn pairs call i with result i."""
    family, tokenizer, template, ends, _, kwargs = _family(name, base_tokenizer_dir)
    check = ToolTurnTemplate(tokenizer, [tokenizer.convert_tokens_to_ids(t) for t in ends], kwargs, chat_template=template)
    results = [{"role": "tool", "name": "add", "content": "3"}, {"role": "tool", "name": "lookup", "content": "sunny"}]
    text = tokenizer.decode(check.tool_turn_ids(results, ["add", "lookup"]))
    assert text.index("response:add{") < text.index("response:lookup{"), text
    assert text.count("response:lookup{") == 1

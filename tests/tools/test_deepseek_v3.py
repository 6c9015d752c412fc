"""DeepSeek-V3 in the tool loop, without the hub: a small byte-level BPE tokenizer with DeepSeek-V3's
special tokens and the model's own chat template (the copy installed with TRL, read at test time).

Checked: the model's template fails the start-up check and is given our training template; ours
passes and renders prompts exactly as the model's; the tool-turn ids are the difference of two
renderings; the parser reads the calls both templates render; a scripted two-round episode trains
on the generated ids plus the tool ids exactly."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from grpo_lightning.agents import AgentSampler, Episode
from grpo_lightning.tools import (
    TemplateError, Toolbox, ToolTurnTemplate, detect_family, get_parser, training_chat_template,
)
from grpo_lightning.tools.parsers import DeepSeekV3ToolCallParser, ToolCall
from grpo_lightning.tools.templates import render_ids
from grpo_lightning.tools.templates_deepseek import DEEPSEEK_V3_TRAINING_TEMPLATE, is_deepseek_v3
from grpo_lightning.types import GenerationParams
from tests.agents.scripted import Handle, ScriptedSampler
from tests.tools.test_schema import multiply

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
MARKERS = ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
           "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]  # fmt: skip
OUTPUTS = "<｜tool▁outputs▁begin｜>{}<｜tool▁outputs▁end｜>"
USER = [{"role": "user", "content": "What is 3 times 4?"}]
_CACHE: dict[str, object] = {}


def original_template() -> str:
    """DeepSeek-V3's chat template as TRL installs it (``trl/chat_templates/deepseekv3.jinja``)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("trl (the dev extra) is not installed: it holds DeepSeek-V3's original chat template")
    path = Path(spec.submodule_search_locations[0]) / "chat_templates" / "deepseekv3.jinja"
    if not path.is_file():
        pytest.skip(f"this trl has no DeepSeek-V3 chat template at {path}")
    return path.read_text(encoding="utf-8")


@pytest.fixture
def tokenizer():
    """A byte-level BPE trained on a few strings, with DeepSeek-V3's special tokens and template."""
    if "tok" not in _CACHE:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[BOS, EOS, *MARKERS],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        bpe.train_from_iterator(["What is 3 times 4?", "function multiply", '```json\n{"a": 3, "b": 4}\n```',
                                 "You are helpful.", "The answer is 12.", "<think>\nLet me think.\n</think>"], trainer)
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS,
                                      additional_special_tokens=MARKERS)
        tok.chat_template = original_template()
        _CACHE["tok"] = tok
    return _CACHE["tok"]


def calls(*pairs, as_text=False):
    """Tool calls in the chat-template format (arguments a mapping, or a JSON string for the model's template)."""
    return [{"type": "function", "function": {"name": n, "arguments": json.dumps(a) if as_text else a}} for n, a in pairs]


def written(*pairs) -> str:
    """Calls as DeepSeek-V3 writes them."""
    body = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>"
                     for n, a in pairs)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def test_the_models_template_is_detected_refused_and_given_ours(tokenizer):
    original = tokenizer.chat_template
    assert is_deepseek_v3(original) and not is_deepseek_v3(DEEPSEEK_V3_TRAINING_TEMPLATE)
    assert detect_family(original) == detect_family(DEEPSEEK_V3_TRAINING_TEMPLATE) == "deepseek-v3"
    with pytest.raises(TemplateError, match="cannot render a tool-call exchange.*deepseek-v3"):
        ToolTurnTemplate(tokenizer, [tokenizer.eos_token_id]).check()  # arguments as a mapping
    # With arguments as JSON strings it renders, but a second round re-renders the first tool turn:
    # <｜tool▁outputs▁end｜> is dropped once an assistant turn follows, and <｜tool▁outputs▁begin｜> never comes again.
    first = [*USER, {"role": "assistant", "content": "", "tool_calls": calls(("multiply", {"a": 3}), as_text=True)},
             {"role": "tool", "content": "12"}]
    prompt = tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
    second = tokenizer.apply_chat_template([*first, first[1], first[2]], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<｜tool▁output▁end｜><｜tool▁outputs▁end｜>") and not second.startswith(prompt)
    assert second.count("<｜tool▁outputs▁begin｜>") == 1 and second.count("<｜tool▁calls▁begin｜>") == 1
    template = training_chat_template(tokenizer, [tokenizer.eos_token_id])
    assert template.chat_template == DEEPSEEK_V3_TRAINING_TEMPLATE
    template.check()  # ours passes
    assert isinstance(get_parser(None, template.chat_template), DeepSeekV3ToolCallParser)
    assert isinstance(get_parser("deepseek-v3", None), DeepSeekV3ToolCallParser)


def test_the_second_round_check_catches_what_one_round_does_not(tokenizer):
    # The model's template with its arguments written by tojson renders the probe and passes one round...
    variant = tokenizer.chat_template.replace("tool['function']['arguments']", "(tool['function']['arguments'] | tojson)")
    assert variant != tokenizer.chat_template
    template = ToolTurnTemplate(tokenizer, [tokenizer.eos_token_id], chat_template=variant)
    assert tokenizer.decode(template.tool_turn_ids([{"role": "tool", "content": "5"}], ["probe"])) == OUTPUTS.format(
        "<｜tool▁output▁begin｜>5<｜tool▁output▁end｜>")
    with pytest.raises(TemplateError, match="appending an assistant turn after tool results re-renders"):
        template.check()  # ...but not two
    clone = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, bos_token=BOS, eos_token=EOS)
    clone.chat_template = variant
    assert training_chat_template(clone, [clone.eos_token_id]).chat_template == DEEPSEEK_V3_TRAINING_TEMPLATE
    # A template whose tool turn depends on the round (numbered results) is refused.
    numbered = ("{%- set ns = namespace(n=0) -%}{{ bos_token }}{%- for m in messages -%}{%- if m.role == 'tool' -%}"
                "{%- set ns.n = ns.n + 1 -%}<｜tool▁output▁begin｜>{{ ns.n }}:{{ m.content }}<｜tool▁output▁end｜>"
                "{%- elif m.role == 'user' -%}<｜User｜>{{ m.content }}{%- else -%}<｜Assistant｜>{{ m.content }}"
                "{%- for c in m.tool_calls or [] -%}{{ c.function.name }}{%- endfor -%}<｜end▁of▁sentence｜>{%- endif -%}"
                "{%- endfor -%}{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}")
    with pytest.raises(TemplateError, match="second round's tool turn renders differently.*qwen3, deepseek-v3"):
        training_chat_template(tokenizer, [tokenizer.eos_token_id], chat_template=numbered)


CONVERSATIONS = [
    USER,
    [{"role": "system", "content": "You are helpful."}, *USER],
    [{"role": "system", "content": "You are helpful."}, {"role": "system", "content": "Be brief."}, *USER],
    [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\nhm\n</think>Hello."}, *USER],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_prompts_render_exactly_as_the_models_template(tokenizer, messages, with_tools, add_generation_prompt):
    tools = Toolbox.of([multiply]).schemas if with_tools else None
    ours = render_ids(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                      chat_template=DEEPSEEK_V3_TRAINING_TEMPLATE)
    assert ours == render_ids(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    if add_generation_prompt:
        assert tokenizer.decode(ours).endswith("<｜Assistant｜><think>\n")


def test_one_round_renders_as_the_models_template(tokenizer):
    """Where the model's template is right (one round, arguments as strings), ours writes the same."""
    def conversation(as_text):
        return [{"role": "system", "content": "You are helpful."}, *USER,
                {"role": "assistant", "content": "Let me compute.",
                 "tool_calls": calls(("multiply", {"a": 3, "b": 4}), ("multiply", {"a": 5, "b": 6}), as_text=as_text)},
                {"role": "tool", "content": "12"}, {"role": "tool", "content": "30"},
                {"role": "assistant", "content": "12 and 30."}]
    ours = render_ids(tokenizer, conversation(False), chat_template=DEEPSEEK_V3_TRAINING_TEMPLATE)
    assert ours == render_ids(tokenizer, conversation(True))


def test_tool_turn_ids_are_the_difference_of_renderings(tokenizer):
    template = training_chat_template(tokenizer, [tokenizer.eos_token_id])
    results = [{"role": "tool", "name": "multiply", "content": c} for c in ("12", "30")]
    ids = template.tool_turn_ids(results, ["multiply", "multiply"])
    expected = OUTPUTS.format("<｜tool▁output▁begin｜>12<｜tool▁output▁end｜><｜tool▁output▁begin｜>30<｜tool▁output▁end｜>")
    assert tokenizer.decode(ids) == expected and ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    # The same ids after a real turn (text, arguments): the full renderings differ by exactly them.
    assistant = {"role": "assistant", "content": "Let me compute.", "tool_calls": calls(("multiply", {"a": 3, "b": 4}))}
    before = template.render([*USER, assistant], add_generation_prompt=False)
    after = template.render([*USER, assistant, *results])
    assert before[-1] == tokenizer.eos_token_id and after[: len(before)] == before and after[len(before):] == ids


@pytest.mark.parametrize("template_name", ["ours", "model's"])
def test_the_parser_reads_what_the_templates_render(tokenizer, template_name):
    pairs = (("multiply", {"a": 3, "b": 4}), ("lookup", {"query": "x ```y``` {z}", "n": [1, 2]}), ("now", {}))
    chat_template = DEEPSEEK_V3_TRAINING_TEMPLATE if template_name == "ours" else None
    assistant = {"role": "assistant", "content": "Let me compute.", "tool_calls": calls(*pairs, as_text=chat_template is None)}
    prompt = render_ids(tokenizer, USER, chat_template=chat_template)
    full = render_ids(tokenizer, [*USER, assistant], chat_template=chat_template)
    text = tokenizer.decode(full[len(prompt):-1])  # the assistant turn, end-of-turn token removed
    assert text.startswith("<｜Assistant｜>")
    turn = DeepSeekV3ToolCallParser().parse("<think>\nFirst multiply.\n</think>" + text.removeprefix("<｜Assistant｜>"))
    assert turn.tool_calls == [ToolCall(n, a) for n, a in pairs] and not turn.malformed
    assert turn.content == "Let me compute." and turn.reasoning_content == "First multiply."
    assert turn.message()["tool_calls"] == calls(*pairs)


PARSER = DeepSeekV3ToolCallParser()


def test_parser_plain_answers_and_forms():
    assert PARSER.parse("<think>\nok\n</think>\n\nThe answer is 12.").message() == {
        "role": "assistant", "content": "The answer is 12.", "reasoning_content": "ok"}
    turn = PARSER.parse(written(("a", {"x": 1})) + "\n")
    assert turn.tool_calls == [ToolCall("a", {"x": 1})] and turn.content == "" and turn.reasoning_content is None
    bare = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>b\n```\n\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert PARSER.parse(bare).tool_calls == [ToolCall("b", {})]  # no json tag, no arguments


@pytest.mark.parametrize("text", [
    written(("a", {"x": 1})).replace('{"x": 1}', '{"x": 1,'),  # invalid JSON
    written(("a", {"x": 1})).replace('{"x": 1}', "[1]"),  # arguments not an object
    written(("a", {"x": 1})).removesuffix("<｜tool▁calls▁end｜>"),  # unclosed section
    written(("a", {"x": 1})).replace("<｜tool▁call▁end｜>", ""),  # unclosed call
    written(("a", {"x": 1})).replace("function<｜tool▁sep｜>a", "function<｜tool▁sep｜> "),  # no name
    written(("a", {"x": 1}), ("b", {})).replace("\n<｜tool▁call▁begin｜>", "and<｜tool▁call▁begin｜>"),  # text between calls
    "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",  # no call
    written(("a", {})) + written(("b", {})),  # two sections
    "Done.<｜tool▁call▁end｜>",  # stray markup
])  # fmt: skip
def test_unreadable_markup_is_a_plain_answer(text):
    turn = PARSER.parse("Sure. " + text)
    assert turn.malformed and turn.tool_calls == [] and turn.content == ("Sure. " + text).strip()
    assert "tool_calls" not in turn.message()


def test_two_round_episode_trains_on_generated_plus_tool_ids(tokenizer):
    tools = Toolbox.of([multiply])
    turns = [written(("multiply", {"a": 3, "b": 4})), "Now 12 times 2." + written(("multiply", {"a": 12, "b": 2})),
             "<think>\ndone\n</think>It is 24."]
    inner = ScriptedSampler(lambda context, j: turns[context.count("<｜tool▁outputs▁end｜>")])
    sampler = AgentSampler(inner, tools)
    sampler.bind(Handle(tokenizer))
    prompt = sampler.render_prompt(USER, tools)
    assert prompt == render_ids(tokenizer, USER, add_generation_prompt=True)  # the model's own prompt rendering
    episode = Episode(list(prompt), tools)
    (rollout,) = sampler.run([episode], GenerationParams(max_completion_length=300))
    eos = tokenizer.eos_token_id
    generated = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in turns]
    outputs = [OUTPUTS.format(f"<｜tool▁output▁begin｜>{r}<｜tool▁output▁end｜>") for r in ("12", "24")]
    tool_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in outputs]
    assert rollout.completion_ids == generated[0] + tool_ids[0] + generated[1] + tool_ids[1] + generated[2]
    assert rollout.tool_mask == [1] * len(generated[0]) + [0] * len(tool_ids[0]) + [1] * len(generated[1]) + \
        [0] * len(tool_ids[1]) + [1] * len(generated[2])
    assert rollout.ended_on_eos and rollout.extra["num_tool_calls"] == 2 and len(inner.calls) == 3
    assert inner.calls[2][0] == [prompt + rollout.completion_ids[: -len(generated[2])]]
    assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert episode.messages[2]["content"] == "Now 12 times 2." and episode.messages[4]["reasoning_content"] == "done"
    # Our template renders the conversation as the ids trained on, except that the first turn followed
    # the generation prompt's "<think>\n" (a rendered assistant turn has none).
    rendered = sampler.template.render(USER + episode.messages[:-1], add_generation_prompt=False)
    think = tokenizer("<think>\n", add_special_tokens=False)["input_ids"]
    assert prompt[-len(think):] == think
    assert rendered == prompt[: -len(think)] + rollout.completion_ids[: -len(generated[2])]


def test_the_template_leaves_tools_out_of_the_prompt_and_the_agent_warns(tokenizer, caplog):
    """DeepSeek-V3's template ignores ``tools``: ``lists_tools`` says so, and the agent's start-up
    warns that the tools must be described in the system prompt."""
    template = training_chat_template(tokenizer, [tokenizer.eos_token_id])
    assert not template.lists_tools(Toolbox.of([multiply]).schemas)
    with caplog.at_level("WARNING", logger="grpo_lightning.agents.tool_loop"):
        AgentSampler(ScriptedSampler(lambda context, j: "x"), Toolbox.of([multiply])).bind(Handle(tokenizer))
    assert "leaves the tool schemas out of the prompt" in caplog.text

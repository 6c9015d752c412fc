"""The tool loop with a scripted policy and the real Qwen tokenizers: the trained ids are the
generated ids plus the tool-turn ids exactly, the tool mask marks which tokens the policy made,
the iteration cap and the completion budget hold, failures are tool messages."""

from __future__ import annotations

import json

import pytest

from grpo_lightning.agents import AgentSampler, Episode
from grpo_lightning.tools import Toolbox
from grpo_lightning.types import GenerationParams
from tests.agents.scripted import Handle, ScriptedSampler, call


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError("boom")


TOOLS = Toolbox.of([multiply, explode])
USER = [{"role": "user", "content": "What is 3 times 4?"}]
KWARGS = {"enable_thinking": False}


def agent(tokenizer, script, *, logprobs=False, **options):
    inner = ScriptedSampler(script, logprobs=logprobs)
    sampler = AgentSampler(inner, TOOLS, chat_template_kwargs=KWARGS, **options)
    sampler.bind(Handle(tokenizer))
    return sampler, inner


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run(sampler, n=1, max_completion_length=200, group=1):
    prompt = sampler.render_prompt(USER, TOOLS)
    episodes = [Episode(list(prompt), TOOLS) for _ in range(n)]
    return prompt, episodes, sampler.run(episodes, GenerationParams(max_completion_length=max_completion_length), group)


def test_trained_ids_are_generated_plus_tool_ids_exactly(qwen):
    family, tokenizer = qwen
    first, answer = call("multiply", a=3, b=4), "3 times 4 is 12."
    sampler, inner = agent(tokenizer, lambda context, j: answer if "<tool_response>" in context else first)
    prompt, (episode,), (rollout,) = run(sampler)
    eos = tokenizer.eos_token_id
    turn1, turn2 = ids(tokenizer, first) + [eos], ids(tokenizer, answer) + [eos]
    tool_turn = sampler.template.tool_turn_ids([{"role": "tool", "name": "multiply", "content": "12"}], ["multiply"])
    assert rollout.prompt_ids == prompt
    assert rollout.completion_ids == turn1 + tool_turn + turn2
    assert rollout.tool_mask == [1] * len(turn1) + [0] * len(tool_turn) + [1] * len(turn2)
    assert rollout.ended_on_eos and rollout.sampling_logprobs is None
    # The second turn was generated from exactly prompt + turn 1 + tool turn, with the budget left.
    assert inner.calls[1] == ([prompt + turn1 + tool_turn], 1, 200 - len(turn1) - len(tool_turn))
    # What the model saw is what the (training) template renders for the whole conversation.
    conversation = USER + episode.messages
    assert episode.messages == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]},
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": answer},
    ]
    rendered = sampler.template.render(conversation[:-1], TOOLS.schemas) + turn2
    assert rendered == prompt + rollout.completion_ids
    assert rollout.extra["num_tool_calls"] == 1 and rollout.extra["num_tool_failures"] == 0


def test_sampler_logprobs_are_concatenated_with_zeros_for_tool_tokens(qwen):
    _, tokenizer = qwen
    sampler, _ = agent(tokenizer, lambda c, j: "done" if "<tool_response>" in c else call("multiply", a=1, b=2), logprobs=True)
    _, _, (rollout,) = run(sampler)
    mask, logprobs = rollout.tool_mask, rollout.sampling_logprobs
    assert len(logprobs) == len(mask) == len(rollout.completion_ids)
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if m == 0)
    turn1 = mask.index(0)
    assert logprobs[:turn1] == pytest.approx([-(i + 1) / 10 for i in range(turn1)])
    assert logprobs[len(mask) - 2:] == pytest.approx([-0.1, -0.2])  # "done" + EOS: a new turn restarts


@pytest.mark.parametrize("cap", [0, 1, 2])
def test_iteration_cap(qwen, cap):
    _, tokenizer = qwen
    sampler, inner = agent(tokenizer, lambda c, j: call("multiply", a=2, b=c.count("<tool_response>")),
                           max_tool_calling_iterations=cap)
    _, (episode,), (rollout,) = run(sampler)
    assert len(inner.calls) == cap + 1  # one generation per round, plus the first turn
    assert rollout.extra["num_tool_calls"] == cap and episode.iterations == cap
    assert sum(1 for m in episode.messages if m["role"] == "tool") == cap
    # turns alternate: policy, tool, policy, ...: 2 * cap + 1 runs of equal mask values
    runs = 1 + sum(1 for a, b in zip(rollout.tool_mask, rollout.tool_mask[1:]) if a != b)
    assert runs == 2 * cap + 1 and rollout.tool_mask[0] == 1 and rollout.tool_mask[-1] == 1


def test_failures_are_tool_messages_and_counted(qwen):
    _, tokenizer = qwen
    first = call("nope") + call("multiply", a=1, c=2) + call("explode", x=1) + call("multiply", a=5, b=6)
    sampler, _ = agent(tokenizer, lambda c, j: "ok" if "<tool_response>" in c else first)
    _, (episode,), (rollout,) = run(sampler)
    tools = [m for m in episode.messages if m["role"] == "tool"]
    assert [json.loads(m["content"])["error"].split(":")[0] if m["content"].startswith("{") else m["content"] for m in tools] == [
        "Tool nope not found (available tools", "Bad arguments for tool multiply", "RuntimeError", "30"]
    assert rollout.extra["num_tool_calls"] == 4 and rollout.extra["num_tool_failures"] == 3


def test_malformed_call_ends_the_loop(qwen):
    _, tokenizer = qwen
    sampler, inner = agent(tokenizer, lambda c, j: '<tool_call>\n{"name": "multiply", "arguments": {"a": 3,\n</tool_call>')
    _, (episode,), (rollout,) = run(sampler)
    assert len(inner.calls) == 1 and set(rollout.tool_mask) == {1} and rollout.extra["num_tool_calls"] == 0
    assert episode.messages[0]["content"].startswith("<tool_call>") and "tool_calls" not in episode.messages[0]


def test_budget_covers_all_turns(qwen):
    _, tokenizer = qwen
    first = call("multiply", a=3, b=4)
    long_answer = "twelve " * 40
    sampler, inner = agent(tokenizer, lambda c, j: long_answer if "<tool_response>" in c else first)
    turn1 = len(ids(tokenizer, first)) + 1
    tool_turn = len(sampler.template.tool_turn_ids([{"role": "tool", "name": "multiply", "content": "12"}], ["multiply"]))
    budget = turn1 + tool_turn + 5
    _, _, (rollout,) = run(sampler, max_completion_length=budget)
    assert len(rollout.completion_ids) == budget and not rollout.ended_on_eos  # the answer was cut
    assert sum(rollout.tool_mask) == turn1 + 5
    # No room for the tool turn and one more token: the tool turn is not added, the call still counts.
    _, (episode,), (rollout,) = run(sampler, max_completion_length=turn1 + tool_turn)
    assert rollout.completion_ids == ids(tokenizer, first) + [tokenizer.eos_token_id] and rollout.ended_on_eos
    assert rollout.extra["num_tool_calls"] == 1 and [m["role"] for m in episode.messages] == ["assistant"]


def test_rows_continue_independently_and_groups_share_the_first_call(qwen):
    _, tokenizer = qwen
    # completion 0 answers at once, completion 1 calls a tool first
    sampler, inner = agent(tokenizer, lambda c, j: "12" if j == 0 or "<tool_response>" in c else call("multiply", a=3, b=4))
    prompt, _, rollouts = run(sampler, n=2, group=2)
    assert inner.calls[0][:2] == ([prompt], 2)  # one prompt, two generations
    assert len(inner.calls) == 2 and len(inner.calls[1][0]) == 1  # only the row that called continues
    assert set(rollouts[0].tool_mask) == {1} and 0 in rollouts[1].tool_mask
    assert [r.extra["num_tool_calls"] for r in rollouts] == [0, 1]


def test_context_limit_stops_the_loop(qwen):
    _, tokenizer = qwen
    first = call("multiply", a=3, b=4)
    sampler, inner = agent(tokenizer, lambda c, j: first)
    prompt = sampler.render_prompt(USER, TOOLS)
    sampler._handle.max_context_length = len(prompt) + len(ids(tokenizer, first)) + 3  # no room for the tool turn
    _, _, (rollout,) = run(sampler)
    assert len(inner.calls) == 1 and set(rollout.tool_mask) == {1} and rollout.extra["num_tool_calls"] == 1


def test_the_back_ends_own_limit_stops_the_loop(qwen):
    """A vLLM engine's or server's ``max_model_len`` below the model's context bounds the loop too."""
    _, tokenizer = qwen
    first = call("multiply", a=3, b=4)
    sampler, inner = agent(tokenizer, lambda c, j: first)
    prompt = sampler.render_prompt(USER, TOOLS)
    sampler._handle.max_context_length = 100_000
    inner.max_sequence_length = len(prompt) + len(ids(tokenizer, first)) + 3
    _, _, (rollout,) = run(sampler)
    assert len(inner.calls) == 1 and set(rollout.tool_mask) == {1} and rollout.extra["num_tool_calls"] == 1


def test_each_turn_fits_the_back_ends_limit_row_by_row(qwen):
    """Rows with little context left are not asked for a longer row's room (a vLLM server refuses
    a request past its ``max_model_len``): each call fits every row it holds."""
    _, tokenizer = qwen
    long_call = call("multiply", a=3, b=4) + " " + "ok " * 60  # row 0's first turn uses much of the context
    script = lambda c, j: "12" if "<tool_response>" in c else (long_call if j == 0 else call("multiply", a=3, b=4))
    sampler, inner = agent(tokenizer, script)
    prompt = sampler.render_prompt(USER, TOOLS)
    limit = len(prompt) + len(ids(tokenizer, long_call)) + 60
    inner.max_sequence_length = limit
    _, _, rollouts = run(sampler, n=2, group=2, max_completion_length=200)
    assert [r.extra["num_tool_calls"] for r in rollouts] == [1, 1]
    assert len(inner.calls) == 3  # the second turns in two calls (the first is the prompt's, as without tools)
    for contexts, _, max_tokens in inner.calls[1:]:
        assert all(len(c) + max_tokens <= limit for c in contexts)
    assert all(len(prompt) + len(r.completion_ids) <= limit for r in rollouts)


def take_screenshot() -> list:
    """Takes a screenshot of the current screen.

    Returns:
        The screenshot image with a description.
    """
    return [{"type": "image", "image": "PIXELS"}, {"type": "text", "text": "Here is the screenshot."}]


def test_multimodal_tool_result_reaches_the_next_turn_as_content_blocks(qwen):
    _, tokenizer = qwen
    inner = ScriptedSampler(lambda c, j: "A cat." if "<tool_response>" in c else call("take_screenshot"))
    tools = Toolbox.of([take_screenshot])
    sampler = AgentSampler(inner, tools, chat_template_kwargs=KWARGS)
    sampler.bind(Handle(tokenizer))
    episode = Episode(sampler.render_prompt(USER, tools), tools)
    (rollout,) = sampler.run([episode], GenerationParams(max_completion_length=200))
    blocks = [{"type": "image", "image": "PIXELS"}, {"type": "text", "text": "Here is the screenshot."}]
    assert episode.messages[1] == {"role": "tool", "name": "take_screenshot", "content": blocks}  # message level: a VLM's input
    assert rollout.extra["tool_images"] == ["PIXELS"]
    # A text-only model reads the text blocks of the result.
    tool_text = tokenizer.decode([t for t, m in zip(rollout.completion_ids, rollout.tool_mask) if m == 0])
    assert "<tool_response>\nHere is the screenshot.\n</tool_response>" in tool_text


def test_ranks_sharing_an_engine_run_the_tool_loop_in_lockstep(shared_assets, tmp_path, monkeypatch):
    """vLLM colocated with tensor parallelism: every generate call is a collective of the ranks
    sharing the engine. A rank whose rollouts stop calling tools earlier pads with empty calls
    instead of leaving the loop (which left the other rank waiting in the engine's gather)."""
    from pathlib import Path

    from tests.gloo_ranks import run_two_ranks

    monkeypatch.setenv("GRPO_SHARED_ASSETS", str(shared_assets))
    run_two_ranks(Path(__file__).with_name("lockstep_child.py"), tmp_path)

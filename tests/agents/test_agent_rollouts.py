"""Agent rollouts through the rollout builder, wired as the datamodule wires ``data.agent``:
environment rewards summed with the reward functions, ``environments`` reaching them, routing
that keeps tools apart, tool tokens out of the loss and the length metrics, ``tools/*`` metrics."""

from __future__ import annotations

import random
import re

import pytest

from grpo_lightning.agents import AgentSettings
from grpo_lightning.agents.examples import IncrementEnv, calculate
from grpo_lightning.data.agent_wiring import wire_agent
from grpo_lightning.data.prompt_format import tokenize_prompt
from grpo_lightning.data.prompt_order import GenerationPlan
from grpo_lightning.data.rollout_builder import Collective, RolloutBuilder, RolloutSettings
from grpo_lightning.errors import ConfigError
from grpo_lightning.rewards import RewardRunner, resolve_reward_funcs
from grpo_lightning.types import GenerationParams
from tests.agents.scripted import Handle, ScriptedSampler, call
from tests.agents.test_environments import CodingEnv, GameEnv

KWARGS = {"enable_thinking": False}
SEEN: dict[str, list] = {}


def format_reward(completions, environments, **kwargs):
    SEEN["environments"] = list(environments)
    return [0.5 if c[-1]["content"] == "Done." else 0.0 for c in completions]


def increment_policy(context: str, j: int) -> str:
    """Completion 0 steps to the target, completion 1 overshoots by one; then answers."""
    if "<tool_response>" in context:
        return "Done."
    target = int(re.findall(r"Increment the counter by (\d)", context)[-1])
    return call("increment", step=target + j % 2)


def builder(tokenizer, agent, reward_funcs, reward_weights=None, dataset=None, script=None):
    dataset, funcs, weights, sampler = wire_agent(agent, dataset, reward_funcs, reward_weights,
                                                  ScriptedSampler(script), KWARGS)
    handle = Handle(tokenizer)
    sampler.bind(handle)
    settings = RolloutSettings(num_generations=2, plan=GenerationPlan(4, 1, 2, 4), gradient_accumulation_steps=1,
                               params=GenerationParams(max_completion_length=200), chat_template_kwargs=KWARGS)
    return RolloutBuilder(settings, sampler, RewardRunner(resolve_reward_funcs(funcs), weights), handle, Collective()), dataset


def test_environment_makes_the_prompts_and_its_reward_adds_to_the_functions(qwen):
    _, tokenizer = qwen
    random.seed(0)
    build, dataset = builder(tokenizer, AgentSettings(environment_factory=IncrementEnv), [format_reward], [2.0],
                             script=increment_policy)
    assert build.rewards.names == ["format_reward", "IncrementEnv"] and build.rewards.weights.tolist() == [2.0, 1.0]
    assert build.sampler.requires_max_steps and len(dataset) >= 4 and dataset[0]["prompt"] == [{"role": "user", "content": ""}]
    rows = [dataset[i] for i in (0, 0, 1, 1)]
    built = build.build(rows, [0, 0, 1, 1], None)
    batch, metrics = built.micro_batches[0], built.micro_batches[0].generation_metrics
    assert metrics["rewards/IncrementEnv/mean"] == 0.5 and metrics["rewards/format_reward/mean"] == 0.5
    assert metrics["reward"] == pytest.approx(2.0 * 0.5 + 0.5)  # weighted functions + the environment's reward, weight 1
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    assert [type(e) for e in SEEN["environments"]] == [IncrementEnv] * 4
    assert [e.counter - e.target for e in SEEN["environments"]] == [0, 1, 0, 1]
    # Every prompt was made by its environment's reset(), with the increment tool described.
    prompts = [tokenizer.decode(ids[m.bool()]) for ids, m in zip(batch.prompt_ids, batch.prompt_mask)]
    assert all("Increment the counter by" in p and '"name": "increment"' in p for p in prompts)
    assert build.sampler.inner.calls[0][1] == 1  # different prompts within a group: generated row by row
    # The tool-result tokens are inside the completions but out of the loss, the token counts and the lengths.
    assert batch.tool_mask is not None and (batch.tool_mask == 0).any()
    policy_tokens = batch.loss_mask.sum(1)
    assert (policy_tokens < batch.completion_mask.sum(1)).all()
    assert metrics["completions/mean_length"] == pytest.approx(float(policy_tokens.float().mean()))
    assert float(batch.num_items_in_batch) == float(policy_tokens.sum())
    tool_text = tokenizer.decode(batch.completion_ids[0][(batch.tool_mask[0] == 0) & batch.completion_mask[0].bool()])
    assert tool_text.startswith("\n<|im_start|>user\n<tool_response>\n")


def test_routing_keeps_tools_apart(qwen):
    _, tokenizer = qwen
    rows = [{"prompt": [{"role": "user", "content": "Go."}], "environment": name} for name in ("coding", "coding", "game", "game")]
    build, _ = builder(tokenizer, AgentSettings(environment_factory={"coding": CodingEnv, "game": GameEnv}), None,
                       dataset="unused.jsonl", script=lambda c, j: "Done." if "<tool_response>" in c else call("run_code", code="1"))
    assert build.rewards.names == ["GameEnv"]  # the only class with get_reward
    built = build.build(rows, [0, 0, 1, 1], None)
    batch = built.micro_batches[0]
    prompts = [tokenizer.decode(ids[m.bool()]) for ids, m in zip(batch.prompt_ids, batch.prompt_mask)]
    assert ['"run_code"' in p for p in prompts] == [True, True, False, False]
    assert ['"move"' in p for p in prompts] == [False, False, True, True]
    assert all("Compute fib(10)." in p for p in prompts[:2])  # CodingEnv.reset's observation, appended
    completions = [tokenizer.decode(ids[m.bool()]) for ids, m in zip(batch.completion_ids, batch.completion_mask)]
    assert all("55" in c for c in completions[:2]) and all("Tool run_code not found" in c for c in completions[2:])
    assert built.micro_batches[0].generation_metrics["tools/failure_frequency"] == 0.5


def test_tools_only_with_a_dataset_generates_groups_together(qwen):
    _, tokenizer = qwen
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)} for a, b in ((3, 4), (3, 4), (8, 9), (8, 9))]

    def policy(context, j):
        if "<tool_response>" in context:
            return context.rsplit("<tool_response>\n", 1)[1].split("\n")[0]
        return call("calculate", expression=re.findall(r"(\d+\+\d+)=", context)[-1])

    build, _ = builder(tokenizer, AgentSettings(tools=[calculate]), ["exact_match_reward"], dataset="unused.jsonl", script=policy)
    built = build.build(rows, [0, 0, 1, 1], None)
    assert build.sampler.inner.calls[0][1] == 2 and len(build.sampler.inner.calls[0][0]) == 2  # 2 prompts x 2
    metrics = built.micro_batches[0].generation_metrics
    assert metrics["rewards/exact_match_reward/mean"] == 1.0 and metrics["tools/call_frequency"] == 1.0


def test_wiring_errors():
    with pytest.raises(ConfigError, match="data.dataset is not set"):
        wire_agent(None, None, ["exact_match_reward"], None, "hf_generate", None)
    with pytest.raises(ConfigError, match="only a single data.agent.environment_factory"):
        wire_agent(AgentSettings(environment_factory={"a": IncrementEnv}), None, None, None, "hf_generate", None)
    with pytest.raises(ConfigError, match="neither tools nor environment_factory"):
        AgentSettings()
    with pytest.raises(ConfigError, match="max_tool_calling_iterations=-1"):
        AgentSettings(tools=[calculate], max_tool_calling_iterations=-1)


def test_chat_template_setting_and_start_up_refusals(qwen, tmp_path):
    from grpo_lightning.agents import AgentSampler, read_chat_template
    from grpo_lightning.tools import Toolbox
    from grpo_lightning.utils.tiny_models import build_char_tokenizer

    family, tokenizer = qwen
    path = tmp_path / "t.jinja"
    path.write_text(tokenizer.chat_template)
    assert read_chat_template(str(path)) == tokenizer.chat_template
    with pytest.raises(ConfigError, match="neither a Jinja template nor a readable file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    sampler = AgentSampler(ScriptedSampler(lambda c, k: ""), Toolbox.of([calculate]), chat_template=tokenizer.chat_template)
    if family == "qwen2.5":
        sampler.bind(Handle(tokenizer))  # the model's own template, given explicitly: used as is
        assert sampler.template.chat_template == tokenizer.chat_template
    else:
        with pytest.raises(ConfigError, match="data.agent: the chat template is not prefix-preserving"):
            sampler.bind(Handle(tokenizer))  # an explicit template is never replaced by a fix
    plain = build_char_tokenizer(chat_template=False)
    with pytest.raises(ConfigError, match="tools need a chat template"):
        AgentSampler(ScriptedSampler(lambda c, k: ""), Toolbox.of([calculate])).bind(Handle(plain))


def test_a_prompt_whose_tool_schemas_overflow_the_context_is_refused_before_generating(qwen):
    """The context check sees the prompt rendered with its tools: the schemas alone can overflow."""
    _, tokenizer = qwen
    rows = [{"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"}] * 2
    build, _ = builder(tokenizer, AgentSettings(tools=[calculate]), ["exact_match_reward"], dataset="unused.jsonl",
                       script=lambda context, j: "7")
    with_tools = len(build.sampler.render_prompt(rows[0]["prompt"], build.sampler.toolbox_for(None, None)))
    text_only = len(tokenize_prompt(rows[0]["prompt"], tokenizer, KWARGS))
    assert with_tools > text_only + 50
    build.handle.max_context_length = text_only + 200 + 10  # room for the text and the completion, not the tools
    with pytest.raises(ValueError, match=rf"row 0 \({with_tools} tokens with its tools\)") as err:
        build.build(rows, [0, 0], None)
    assert "max_completion_length=200" in str(err.value)
    assert not build.sampler.inner.calls  # refused before the policy generated anything

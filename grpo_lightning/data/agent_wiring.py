"""How ``data.agent`` joins the data side: the wrapped sampler, the environments' rewards, the
prompts an environment makes, and one generation batch of agent rollouts.

No lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from grpo_lightning.agents import AgentSampler, AgentSettings, EnvironmentSet, Episode, add_observation, resolve_tools
from grpo_lightning.agents.settings import read_chat_template
from grpo_lightning.data.multimodal import multimodal_messages, row_images
from grpo_lightning.data.prompt_format import check_context_length
from grpo_lightning.data.sampling import generate_checked
from grpo_lightning.data.sources import is_conversational
from grpo_lightning.errors import ConfigError
from grpo_lightning.rewards.loading import RewardFunction
from grpo_lightning.samplers import Sampler, get_sampler
from grpo_lightning.types import PolicyHandle, Rollout
from grpo_lightning.utils.lazy_defaults import fresh_instance

#: Rows of the placeholder dataset used when the environment makes every prompt (TRL builds
#: one generation batch's worth; any number at least that large trains the same).
PLACEHOLDER_ROWS = 4096


def wire_agent(
    agent: AgentSettings | None, dataset: Any, reward_funcs: list[Any] | None, reward_weights: list[float] | None,
    sampler: str | Sampler, chat_template_kwargs: dict[str, Any] | None,
) -> tuple[Any, list[Any] | None, list[float] | None, str | Sampler]:
    """The datamodule's ``dataset, reward_funcs, reward_weights, sampler`` with ``data.agent`` applied.

    With an agent: the sampler wrapped in an :class:`AgentSampler`; one reward function per
    environment class with ``get_reward`` appended (weight 1.0); and, without a dataset, a
    placeholder of empty user prompts that ``reset()`` fills (one environment only).

    Raises:
        ConfigError: No dataset where one is needed.
    """
    if agent is None:
        if dataset is None:
            raise ConfigError("data.dataset is not set: give the prompt dataset (only data.agent.environment_factory "
                              "can make the prompts without one).")
        return dataset, reward_funcs, reward_weights, sampler
    environments = EnvironmentSet(agent.environment_factory) if agent.environment_factory is not None else None
    wrapped = AgentSampler(
        get_sampler(fresh_instance(sampler)), resolve_tools(agent.tools), environments,
        max_tool_calling_iterations=agent.max_tool_calling_iterations, tool_timeout_s=agent.tool_timeout_s,
        parser=agent.parser, chat_template=read_chat_template(agent.chat_template), chat_template_kwargs=chat_template_kwargs,
    )
    funcs = list(reward_funcs or [])
    env_rewards: list[RewardFunction] = environments.reward_functions() if environments is not None else []
    if reward_weights is not None and len(reward_weights) == len(funcs):
        reward_weights = [*reward_weights, *[1.0] * len(env_rewards)]  # reward_weights apply to reward_funcs only
    funcs.extend(env_rewards)
    if dataset is None:
        if environments is None or environments.routed:
            raise ConfigError(
                "data.dataset is not set: only a single data.agent.environment_factory whose reset() returns the "
                "prompt can train without a dataset (several environments are routed by a dataset's "
                "'environment' column)."
            )
        dataset = placeholder_dataset()
        wrapped.requires_max_steps = True
    return dataset, funcs, reward_weights, wrapped


#: The prompt of a row when the environment makes it: ``reset()``'s text is appended to it.
ENVIRONMENT_PROMPT: list[dict[str, str]] = [{"role": "user", "content": ""}]


def placeholder_dataset(rows: int = PLACEHOLDER_ROWS) -> Any:
    """Rows with an empty user message: the prompt is what each environment's ``reset()`` returns."""
    import datasets

    return datasets.Dataset.from_dict({"prompt": [ENVIRONMENT_PROMPT] * rows})


def environment_prompt(agent: AgentSettings | None) -> list[dict[str, str]] | None:
    """The prompt of rows without one (a dataset that only routes, as the seed's several
    environments): an empty user message that ``reset()`` fills; ``None`` without environments."""
    return ENVIRONMENT_PROMPT if agent is not None and agent.environment_factory is not None else None


@dataclass
class AgentBatch:
    """The rows of one generation batch on one rank, each with its environment and tools."""

    sampler: AgentSampler
    rows: list[dict[str, Any]]
    names: list[str | None]
    environments: list[Any] | None
    episodes: list[Episode] = field(default_factory=list)

    def generate(self, handle: PolicyHandle, settings: Any, row_ids: Sequence[int]) -> list[Rollout]:
        """Render every row's prompt with its tools and run the tool loop; one rollout per row.

        ``settings`` is the builder's ``RolloutSettings`` (``params``, ``num_generations``).
        """
        sampler, tools_of = self.sampler, self.sampler.toolbox_for
        toolboxes = [tools_of(name, env) for name, env in zip(self.names, self.environments or [None] * len(self.rows))]
        prompt_ids: list[list[int]] = []
        for i, (row, toolbox) in enumerate(zip(self.rows, toolboxes)):
            same = i > 0 and self.environments is None and row_ids[i] == row_ids[i - 1]  # same prompt, same tools
            prompt_ids.append(prompt_ids[-1] if same else _render(sampler, row, row_ids[i], toolbox))
        check_context_length(prompt_ids, row_ids, settings.params.max_completion_length,
                             getattr(handle, "max_context_length", None), counted=" with its tools")
        self.episodes = [Episode(ids, toolbox, env) for ids, toolbox, env in
                         zip(prompt_ids, toolboxes, self.environments or [None] * len(self.rows))]
        group = settings.num_generations if _runs_of(prompt_ids, settings.num_generations) else 1

        def checked(prompts: Sequence[Sequence[int]], n: int, params: Any) -> list[Rollout]:
            return generate_checked(sampler.inner, handle, prompts, n, params)

        return sampler.run(self.episodes, settings.params, group, checked)

    def completions(self) -> list[list[dict[str, Any]]]:
        """What reward functions receive as ``completions``: each rollout's messages (assistant
        turns with their ``tool_calls``, tool results), as TRL gives them."""
        return [list(e.messages) for e in self.episodes]


def start_agent_batch(sampler: Sampler, rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], AgentBatch | None]:
    """``rows`` (one per rollout) and their agent batch; without an agent, ``(rows, None)``.

    Each rollout gets an environment instance from the pool, and ``reset(**row)``'s observation
    is appended to its prompt's last message.
    """
    rows = list(rows)
    if not isinstance(sampler, AgentSampler):
        return rows, None
    bad = next((row["prompt"] for row in rows if not is_conversational(row["prompt"])), None)
    if bad is not None:
        raise ConfigError(
            f"tools need conversational prompts (chat messages), but a prompt is plain text: {bad!r:.80}. Set "
            "data.prompt_as_chat: true to wrap text prompts as a user message."
        )
    envs = sampler.environments
    if envs is None:
        return rows, AgentBatch(sampler, rows, [None] * len(rows), None)
    names = [envs.route(row) for row in rows]
    instances = envs.acquire(names)
    rows = [{**row, "prompt": add_observation(row["prompt"], envs.reset(env, row))} for row, env in zip(rows, instances)]
    return rows, AgentBatch(sampler, rows, names, instances)


def _render(sampler: AgentSampler, row: dict[str, Any], row_id: int, toolbox: Any) -> list[int]:
    """A row's prompt rendered with its tools; a row with images: with them, the image parts
    opening its first user message (as for a dataset image prompt without tools)."""
    images = row_images(row, row_id)
    if images is None:
        return sampler.render_prompt(row["prompt"], toolbox)
    return sampler.render_prompt(multimodal_messages(row["prompt"], len(images), row_id), toolbox, images)


def _runs_of(prompt_ids: list[list[int]], size: int) -> bool:
    """The rows come in runs of ``size`` identical prompts (their first turns can be generated together)."""
    if size < 2 or len(prompt_ids) % size:
        return False
    return all(prompt_ids[i] == prompt_ids[start] for start in range(0, len(prompt_ids), size)
               for i in range(start, start + size))


def gathered_tool_metrics(rollouts: Sequence[Rollout], gather_rows: Any, counted: Any, device: Any) -> dict[str, float]:
    """``tools/call_frequency`` and ``tools/failure_frequency`` over every rank's rollouts that
    count (``counted``: ``(N,)`` bool or ``None``); empty for rollouts without tools."""
    import torch

    from grpo_lightning.agents import NUM_TOOL_CALLS, NUM_TOOL_FAILURES
    from grpo_lightning.data.completion_metrics import tool_metrics

    if not any(NUM_TOOL_CALLS in r.extra for r in rollouts):
        return {}
    local = torch.tensor([[r.extra.get(NUM_TOOL_CALLS, 0), r.extra.get(NUM_TOOL_FAILURES, 0)] for r in rollouts],
                         dtype=torch.float32, device=device)  # (B, 2)
    counts = gather_rows(local)  # (N, 2)
    if counted is not None:
        counts = counts[counted]
    return tool_metrics(counts[:, 0].cpu(), counts[:, 1].cpu())


__all__ = ["AgentBatch", "ENVIRONMENT_PROMPT", "PLACEHOLDER_ROWS", "environment_prompt", "gathered_tool_metrics", "placeholder_dataset", "start_agent_batch", "wire_agent"]

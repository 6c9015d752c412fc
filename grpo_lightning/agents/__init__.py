"""Agent training: the multi-turn tool loop around a sampler, and environments.

Layer L3: drives a Sampler (L2) with tools (L1); the data side (L4) wires it in.
"""

from grpo_lightning.agents.environments import EnvironmentSet, add_observation, environment_reward
from grpo_lightning.agents.episode import AGENT_FIELDS, NUM_TOOL_CALLS, NUM_TOOL_FAILURES, TOOL_IMAGES, Episode
from grpo_lightning.agents.settings import AgentSettings, read_chat_template, resolve_tools
from grpo_lightning.agents.tool_loop import AgentSampler

__all__ = [
    "AGENT_FIELDS", "AgentSampler", "AgentSettings", "EnvironmentSet", "Episode", "NUM_TOOL_CALLS",
    "NUM_TOOL_FAILURES", "TOOL_IMAGES", "add_observation", "environment_reward", "read_chat_template",
    "resolve_tools",
]  # fmt: skip

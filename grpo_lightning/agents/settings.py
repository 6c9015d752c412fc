"""``data.agent``: the settings of agent training (tools, environments, the tool loop).

Layer L3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from grpo_lightning.errors import ConfigError, raised_in_package
from grpo_lightning.rewards.loading import import_dotted_path
from grpo_lightning.tools import Tool, Toolbox, ToolSchemaError


@dataclass
class AgentSettings:
    """Tool use and environments (TRL's ``tools``, ``environment_factory``,
    ``max_tool_calling_iterations``). See docs/agents.md.

    Args:
        tools: Tool functions the model may call: dotted paths (``my_pkg.tools.multiply``) or
            callables, sync or ``async def``, each with type hints on every parameter and a
            Google-style docstring (description, ``Args:``, ``Returns:``).
        environment_factory: A class (or factory function) making one environment per rollout,
            given by dotted path or as a callable; or a mapping ``{name: factory}``, a row's
            ``environment`` column then picking its environment. An environment has
            ``reset(**row)`` (returns ``None`` or text appended to the prompt), optionally
            ``get_reward()`` (an extra reward, weight 1, logged under its class name); its other
            public methods are tools.
        max_tool_calling_iterations: Most rounds of tool calls per rollout; ``None``: until the
            model answers without a call, or the completion (all turns and tool results) reaches
            ``max_completion_length``, or the sequence the model's context.
        tool_timeout_s: Seconds one tool call may run before it fails with a timeout; a sync
            tool then runs on a worker thread. ``None``: no limit, and sync tools run on the
            training thread (for state bound to a thread, e.g. a ``sqlite3`` connection).
        parser: The tool-call format: a family (``qwen2.5``, ``qwen3``, ``hermes``, ``deepseek-v3``), the dotted
            path of a ``grpo_lightning.tools.ToolCallParser`` subclass, or ``None`` to detect it
            from the chat template.
        chat_template: A prefix-preserving chat template (Jinja text, or the path of a file holding
            it) used instead of the model's; by default the model's, or its known fixed training
            template (Qwen3).
    """

    tools: list[str | Callable] = field(default_factory=list)
    environment_factory: str | Callable | dict[str, str | Callable] | None = None
    max_tool_calling_iterations: int | None = None
    tool_timeout_s: float | None = 30.0
    parser: str | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if not self.tools and self.environment_factory is None:
            raise ConfigError(
                "data.agent has neither tools nor environment_factory: give at least one tool function or an "
                "environment, or remove data.agent."
            )
        iterations = self.max_tool_calling_iterations
        if iterations is not None and (isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0):
            raise ConfigError(
                f"data.agent.max_tool_calling_iterations={iterations!r}: use a non-negative integer, or null for no limit."
            )
        if self.tool_timeout_s is not None and not self.tool_timeout_s > 0:
            raise ConfigError(f"data.agent.tool_timeout_s={self.tool_timeout_s!r}: use a positive number of seconds, or null.")
        if isinstance(self.environment_factory, dict) and not self.environment_factory:
            raise ConfigError("data.agent.environment_factory is an empty mapping: name at least one environment.")


def resolve_callable(spec: Any, setting: str) -> Callable[..., Any]:
    """A dotted path imported, a callable as is."""
    try:
        obj = import_dotted_path(spec) if isinstance(spec, str) else spec
    except ValueError as err:
        if not raised_in_package(err):  # the user's module failed while importing: its own traceback
            raise
        raise ConfigError(f"{setting}={spec!r}: {err}") from err
    if not callable(obj):
        raise ConfigError(f"{setting}={spec!r} is not callable.")
    return obj


def resolve_tools(specs: list[Any]) -> Toolbox:
    """The standalone tools of ``data.agent.tools``, schemas read now (a bad docstring fails at start-up)."""
    tools = []
    for index, spec in enumerate(specs):
        func = resolve_callable(spec, f"data.agent.tools[{index}]")
        try:
            tools.append(Tool.of(func))
        except ToolSchemaError as err:
            raise ConfigError(f"data.agent.tools: {err}") from err
    try:
        return Toolbox(tools)
    except ValueError as err:
        raise ConfigError(f"data.agent.tools: {err}") from err


def read_chat_template(value: str | None) -> str | None:
    """``data.agent.chat_template``: Jinja text, or the path of a file that holds it."""
    if value is None or "{" in value:
        return value
    try:
        with open(value) as f:
            return f.read()
    except OSError as err:
        raise ConfigError(
            f"data.agent.chat_template={value!r} is neither a Jinja template nor a readable file ({err})."
        ) from err


__all__ = ["AgentSettings", "read_chat_template", "resolve_callable", "resolve_tools"]

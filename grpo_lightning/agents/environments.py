"""Environments (``data.agent.environment_factory``): one stateful instance per rollout.

An environment has ``reset(**row)`` (required; returns ``None`` or the text appended to the
prompt's last message), an optional sync or async ``get_reward()``, and public methods that are the
rollout's tools. Each factory is called once at start-up (a probe: its methods give the tool
schemas, and it seeds the pool); instances are pooled and reused across generation batches, so an
expensive ``__init__`` runs once per concurrent rollout, not once per step.

With a mapping ``{name: factory}`` each row's ``environment`` column picks its environment, and
the rollout sees only that environment's tools.

Layer L3.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Mapping, Sequence

from grpo_lightning.agents.settings import resolve_callable
from grpo_lightning.errors import ConfigError
from grpo_lightning.rewards.loading import RewardFunction
from grpo_lightning.tools import Tool, Toolbox, ToolSchemaError
from grpo_lightning.tools.toolbox import is_async_function
from grpo_lightning.utils import async_loop

#: The dataset column that routes a row to its environment (never passed to ``reset``).
ROUTING_COLUMN = "environment"
RESERVED_METHODS = ("reset", "get_reward")


def public_methods(instance: Any) -> list[str]:
    """Names of the public methods of ``instance`` that are tools (definition order, subclass
    first; ``reset`` and ``get_reward`` excluded; properties are never evaluated)."""
    names: list[str] = []
    for cls in type(instance).__mro__:
        if cls is object:
            continue
        for name, member in vars(cls).items():
            if name.startswith("_") or name in RESERVED_METHODS or name in names:
                continue
            if isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
                names.append(name)
    return names


class EnvironmentSet:
    """The configured environments: factories by name, their tools, and the instance pool.

    Args:
        factory: ``data.agent.environment_factory``: a factory (class, function, dotted path) or
            a mapping name -> factory.
    """

    def __init__(self, factory: Any) -> None:
        self.routed = isinstance(factory, Mapping)
        specs = dict(factory) if self.routed else {None: factory}
        self.factories: dict[str | None, Callable[[], Any]] = {}
        self._tools: dict[str | None, list[Tool]] = {}
        self._pool: dict[str | None, list[Any]] = {}
        for name, spec in specs.items():
            setting = "data.agent.environment_factory" + (f"[{name!r}]" if self.routed else "")
            make = resolve_callable(spec, setting)
            probe = make()
            if not callable(getattr(probe, "reset", None)):
                raise ConfigError(
                    f"{setting} made a {type(probe).__name__}, which has no reset() method: an environment needs "
                    "reset(**row), returning None or the text to append to the prompt."
                )
            try:
                self._tools[name] = [Tool.of(getattr(probe, method)) for method in public_methods(probe)]
                Toolbox(self._tools[name])
            except ToolSchemaError as err:
                raise ConfigError(f"{setting}: environment {type(probe).__name__}: {err}") from err
            self.factories[name] = make
            self._pool[name] = [probe]

    @property
    def names(self) -> list[str | None]:
        return list(self.factories)

    def route(self, row: Mapping[str, Any]) -> str | None:
        """The environment name of ``row`` (``None`` for a single unnamed environment)."""
        if not self.routed:
            return None
        name = row.get(ROUTING_COLUMN)
        if name not in self.factories:
            shown = "no 'environment' column" if ROUTING_COLUMN not in row else f"environment={name!r}"
            raise ValueError(
                f"a row has {shown}, but data.agent.environment_factory maps the names {sorted(self.factories)}: "
                "give every row an 'environment' column holding one of them."
            )
        return name

    def acquire(self, names: Sequence[str | None]) -> list[Any]:
        """One instance per rollout, from the pool (grown when a batch needs more). The instances
        of the previous batch are reused: a batch's environments live until the next batch."""
        used: dict[str | None, int] = {}
        instances = []
        for name in names:
            index = used.get(name, 0)
            pool = self._pool[name]
            while len(pool) <= index:
                pool.append(self.factories[name]())
            instances.append(pool[index])
            used[name] = index + 1
        return instances

    def toolbox(self, name: str | None, instance: Any) -> Toolbox:
        """The tools of one rollout: its environment's methods, bound to its instance."""
        return Toolbox(tool.bound_to(getattr(instance, tool.name)) for tool in self._tools[name])

    def tool_names(self, name: str | None) -> list[str]:
        """The tool names of environment ``name`` (its public methods)."""
        return [tool.name for tool in self._tools[name]]

    def schemas(self, name: str | None) -> list[dict[str, Any]]:
        return [tool.schema for tool in self._tools[name]]

    def reset(self, instance: Any, row: Mapping[str, Any]) -> Any:
        """``instance.reset(**row)``, the routing column left out when environments are routed
        (TRL's call: the ``prompt`` is among the arguments); the observation (``None``, text, or a
        list of content blocks)."""
        kwargs = {k: v for k, v in row.items() if not (self.routed and k == ROUTING_COLUMN)}
        observation = instance.reset(**kwargs)
        if inspect.isawaitable(observation):
            observation = async_loop.run(_awaited(observation))
        if observation is not None and not isinstance(observation, (str, list)):
            raise TypeError(
                f"{type(instance).__name__}.reset() returned {type(observation).__name__}: it must return None, "
                "a string (appended to the prompt) or a list of content blocks."
            )
        return observation

    def reward_functions(self) -> list[RewardFunction]:
        """One reward function per environment class that defines ``get_reward`` (named after
        the class; ``None`` for rollouts of other environments)."""
        classes = []
        for pool in self._pool.values():
            cls = type(pool[0])
            if callable(getattr(cls, "get_reward", None)) and cls not in classes:
                classes.append(cls)
        return [environment_reward(cls) for cls in classes]


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def environment_reward(cls: type) -> RewardFunction:
    """The reward function of ``cls.get_reward``: each rollout's environment scores itself."""
    if is_async_function(cls.get_reward):

        async def reward(environments: Sequence[Any], **kwargs: Any) -> list[Any]:
            mine = [i for i, env in enumerate(environments) if type(env) is cls]
            values = await asyncio.gather(*(environments[i].get_reward() for i in mine))
            out: list[Any] = [None] * len(environments)
            for i, value in zip(mine, values):
                out[i] = value
            return out

    else:

        def reward(environments: Sequence[Any], **kwargs: Any) -> list[Any]:
            return [env.get_reward() if type(env) is cls else None for env in environments]

    reward.__name__ = reward.__qualname__ = cls.__name__
    return RewardFunction(cls.__name__, reward, is_async_function(cls.get_reward))


def add_observation(prompt: Any, observation: Any) -> Any:
    """The prompt with ``reset``'s observation appended to its last message (a copy)."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + (observation if isinstance(observation, str) else "".join(
            b.get("text", "") for b in observation if isinstance(b, dict)))
    messages = [dict(m) for m in prompt]
    content = messages[-1].get("content") or ""
    if isinstance(content, str) and isinstance(observation, str):
        messages[-1]["content"] = content + observation
    else:
        blocks = content if isinstance(content, list) else ([{"type": "text", "text": content}] if content else [])
        extra = observation if isinstance(observation, list) else [{"type": "text", "text": observation}]
        messages[-1]["content"] = [*blocks, *extra]
    return messages


__all__ = ["EnvironmentSet", "ROUTING_COLUMN", "add_observation", "environment_reward", "public_methods"]

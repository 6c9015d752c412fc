"""Environments: the probe and its tools, the reuse pool, reset(**row), get_reward as a reward
function named after the class, routing by the ``environment`` column."""

from __future__ import annotations

import asyncio

import pytest

from grpo_lightning.agents import EnvironmentSet, add_observation
from grpo_lightning.agents.environments import public_methods
from grpo_lightning.agents.examples import IncrementEnv
from grpo_lightning.errors import ConfigError


class CodingEnv:
    made = 0

    def __init__(self):
        CodingEnv.made += 1

    def reset(self, **kwargs) -> str:
        self.seen = kwargs
        return "Compute fib(10)."

    def run_code(self, code: str) -> str:
        """Run code.

        Args:
            code: The Python source.
        """
        return "55"

    @property
    def expensive(self):
        raise AssertionError("a property is never evaluated")

    def _helper(self):
        pass


class GameEnv:
    def reset(self, **kwargs) -> None:
        return None

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return 0.5

    def move(self, action: str) -> str:
        """Move.

        Args:
            action: Up, down, left or right.
        """
        return "moved"


def test_public_methods_are_the_tools():
    assert public_methods(CodingEnv()) == ["run_code"]
    assert public_methods(IncrementEnv()) == ["increment"]


def test_probe_pool_and_reuse():
    CodingEnv.made = 0
    envs = EnvironmentSet(CodingEnv)
    assert CodingEnv.made == 1  # the probe
    first = envs.acquire([None] * 3)
    assert CodingEnv.made == 3 and len({id(e) for e in first}) == 3
    again = envs.acquire([None] * 2)
    assert CodingEnv.made == 3 and again == first[:2]  # reused, not rebuilt
    assert envs.schemas(None)[0]["function"]["name"] == "run_code"
    assert envs.toolbox(None, first[1])["run_code"].func.__self__ is first[1]  # bound to its rollout's instance


def test_reset_gets_the_row_with_its_prompt_and_without_the_routing_column():
    """TRL's ``reset(**row)``: an environment written ``reset(self, prompt, **kwargs)`` works."""
    envs = EnvironmentSet({"coding": CodingEnv})
    (env,) = envs.acquire(["coding"])
    prompt = [{"role": "user", "content": "x"}]
    observation = envs.reset(env, {"prompt": prompt, "environment": "coding", "level": 3})
    assert observation == "Compute fib(10)." and env.seen == {"prompt": prompt, "level": 3}


def test_routing_and_its_errors():
    envs = EnvironmentSet({"coding": CodingEnv, "game": "tests.agents.test_environments.GameEnv"})
    assert [envs.route({"environment": n}) for n in ("game", "coding")] == ["game", "coding"]
    with pytest.raises(ValueError, match="environment='chess'.*'coding', 'game'"):
        envs.route({"environment": "chess"})
    with pytest.raises(ValueError, match="no 'environment' column"):
        envs.route({"prompt": "x"})
    coding, game = envs.acquire(["coding", "game"])
    assert list(envs.toolbox("coding", coding)) == ["run_code"] and list(envs.toolbox("game", game)) == ["move"]


def test_get_reward_functions_named_after_their_class():
    envs = EnvironmentSet({"increment": IncrementEnv, "game": GameEnv, "coding": CodingEnv})
    rewards = {rf.name: rf for rf in envs.reward_functions()}
    assert set(rewards) == {"IncrementEnv", "GameEnv"}  # CodingEnv has no get_reward
    inc, game, coding = envs.acquire(["increment", "game", "coding"])
    inc.reset(target=2)
    inc.increment(2)
    environments = [inc, game, coding]
    assert rewards["IncrementEnv"].func(environments=environments, prompts=[]) == [1.0, None, None]
    assert rewards["GameEnv"].is_async
    assert asyncio.run(rewards["GameEnv"].func(environments=environments)) == [None, 0.5, None]


def test_bad_environments_fail_at_start_up():
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: X.
            """

    class BadTool:
        def reset(self):
            pass

        def act(self, x):
            return x

    with pytest.raises(ConfigError, match="no reset"):
        EnvironmentSet(NoReset)
    with pytest.raises(ConfigError, match="BadTool: tool 'act' has no docstring"):
        EnvironmentSet(BadTool)
    envs = EnvironmentSet(lambda: type("R", (), {"reset": lambda self, **k: 42})())
    with pytest.raises(TypeError, match="returned int"):
        envs.reset(envs.acquire([None])[0], {})


def test_observation_appended_to_the_last_message():
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "Go. "}]
    assert add_observation(prompt, "Target 3.")[-1]["content"] == "Go. Target 3." and prompt[-1]["content"] == "Go. "
    assert add_observation(prompt, None) is prompt
    image = {"type": "image", "image": "IMG"}
    assert add_observation(prompt, [image])[-1]["content"] == [{"type": "text", "text": "Go. "}, image]
    assert add_observation([{"role": "user", "content": ""}], "Increment.")[-1]["content"] == "Increment."


def test_a_tool_named_like_an_environment_method_fails_at_start_up():
    from grpo_lightning.agents import AgentSampler
    from grpo_lightning.samplers import HFGenerateSampler
    from grpo_lightning.tools import Toolbox

    def move(action: str) -> str:
        """Move elsewhere.

        Args:
            action: Where to.
        """
        return action

    environments = EnvironmentSet({"code": CodingEnv, "game": GameEnv})
    with pytest.raises(ConfigError, match=r"data.agent.tools and the methods of "
                                          r"data.agent.environment_factory\['game'\] both define \['move'\]"):
        AgentSampler(HFGenerateSampler(), Toolbox.of([move]), environments)
    AgentSampler(HFGenerateSampler(), Toolbox.of([move]), EnvironmentSet(CodingEnv))  # no clash: fine

"""Every configs/agents/ recipe parses, with its data.agent settings (they train in test_agent_fit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_lightning.cli import GRPOLightningCLI, TRAINER_DEFAULTS
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "agents").glob("*.yaml"))


class ParseOnly(GRPOLightningCLI):
    def instantiate_classes(self) -> None:
        pass


def test_the_three_recipes_exist():
    assert {c.name for c in CONFIGS} == {"calculator_arithmetic.yaml", "increment_env.yaml", "qwen3-0.6b_tools.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_agent_config_parses(config, monkeypatch):
    monkeypatch.chdir(config.parents[2])
    cli = ParseOnly(GRPOModule, RolloutDataModule, trainer_defaults=TRAINER_DEFAULTS, run=False, args=["--config", str(config)])
    agent = cli.config.data.agent
    assert agent.tools or agent.environment_factory
    assert cli.config.data.reward_funcs or agent.environment_factory  # the environment scores itself

"""Every shipped config parses and validates against the current signatures (no model is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_lightning.cli import GRPOLightningCLI, LogConfigToMLflow, TRAINER_DEFAULTS
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


class ParseOnly(GRPOLightningCLI):
    """Parses and validates the config, instantiates nothing."""

    def instantiate_classes(self) -> None:
        pass


def test_configs_exist():
    names = {c.name for c in CONFIGS}
    assert {"quickstart.yaml", "gsm8k_qwen2.5-0.5b.yaml"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses(config, monkeypatch):
    monkeypatch.chdir(config.parents[1])  # configs use repo-relative paths
    cli = ParseOnly(
        GRPOModule, RolloutDataModule, trainer_defaults=TRAINER_DEFAULTS, save_config_callback=LogConfigToMLflow,
        run=False, args=["--config", str(config)],
    )
    assert cli.config.data.reward_funcs, "a config without rewards cannot train"
    assert cli.config.model.model

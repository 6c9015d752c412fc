"""The GPU strategy recipes (configs/strategy/) and the checks around them, on CPU.

Each recipe composes with a training recipe through two ``--config`` files and builds its
strategy object; FSDP1's block policy wraps every transformer block; the combinations the module
cannot train correctly are refused at setup with the setting and the fix. Training under each
strategy needs CUDA (Lightning refuses FSDP and DeepSpeed without it): tests/test_configs.py
trains them where a GPU is present, tests/module/test_deepspeed.py runs DeepSpeed's CPU engine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.cli import GRPOLightningCLI, LogConfigToMLflow, TRAINER_DEFAULTS
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.errors import ConfigError
from grpo_lightning.module import GRPOModule

REPO = Path(__file__).resolve().parents[2]
STRATEGIES = sorted((REPO / "configs" / "strategy").glob("*.yaml"))
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (pip install "
                                     "'grpo-lightning[deepspeed]'; not part of [dev])")


class ParseOnly(GRPOLightningCLI):
    def instantiate_classes(self) -> None:
        pass


def parse(*configs: Path):
    return ParseOnly(GRPOModule, RolloutDataModule, trainer_defaults=TRAINER_DEFAULTS, save_config_callback=LogConfigToMLflow,
                     run=False, args=[a for c in configs for a in ("--config", str(c))])


def build_strategy(config):
    """The strategy object of a parsed config (nested class_paths instantiated as the CLI would)."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    strategy = config.trainer.strategy
    return parser.instantiate_classes(parser.parse_object({"strategy": strategy.as_dict()})).strategy


def test_strategy_recipes_exist():
    assert {p.name for p in STRATEGIES} == {"fsdp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"}


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda p: p.name)
def test_strategy_recipe_composes_with_a_training_recipe(strategy, monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = REPO / "configs" / "gsm8k_qwen2.5-0.5b.yaml"
    alone, composed = parse(recipe), parse(recipe, strategy)
    assert composed.config.trainer.precision == "bf16-mixed" and composed.config.trainer.accelerator == "gpu"
    assert composed.config.trainer.devices == "auto"  # the strategy recipe's: later files override
    # everything else is the training recipe's
    assert composed.config.model == alone.config.model and composed.config.data == alone.config.data
    assert composed.config.trainer.max_steps == alone.config.trainer.max_steps == 500
    assert alone.config.trainer.strategy == "auto"


def test_fsdp_recipe_builds_its_strategy(monkeypatch):
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import ShardingStrategy

    from grpo_lightning.module.sharding import TransformerBlockPolicy

    monkeypatch.chdir(REPO)
    strategy = build_strategy(parse(REPO / "configs/quickstart.yaml", REPO / "configs/strategy/fsdp.yaml").config)
    assert type(strategy) is FSDPStrategy and strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert isinstance(strategy.kwargs["auto_wrap_policy"], TransformerBlockPolicy)
    assert strategy._state_dict_type == "full" and strategy.kwargs["use_orig_params"]


@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_recipes_build_their_strategy(stage, monkeypatch):
    from grpo_lightning.module.deepspeed_strategy import GRPODeepSpeedStrategy

    monkeypatch.chdir(REPO)
    recipe = REPO / f"configs/strategy/deepspeed_zero{stage}.yaml"
    strategy = build_strategy(parse(REPO / "configs/quickstart.yaml", recipe).config)
    assert type(strategy) is GRPODeepSpeedStrategy and strategy.config["zero_optimization"]["stage"] == stage
    assert strategy.zero_stage_3 == (stage == 3) and strategy.ds3_gather_for_generation is True


@needs_deepspeed
def test_ds3_gather_for_generation_is_settable_from_the_command_line(monkeypatch):
    monkeypatch.chdir(REPO)
    cli = ParseOnly(GRPOModule, RolloutDataModule, trainer_defaults=TRAINER_DEFAULTS, run=False,
                    args=["--config", "configs/quickstart.yaml", "--config", "configs/strategy/deepspeed_zero3.yaml",
                          "--trainer.strategy.init_args.ds3_gather_for_generation", "false",
                          "--trainer.strategy.init_args.offload_optimizer", "true"])
    strategy = build_strategy(cli.config)
    assert strategy.ds3_gather_for_generation is False
    assert strategy.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_grpo_deepspeed_strategy_names_the_extra_when_deepspeed_is_missing(monkeypatch):
    import grpo_lightning.module.deepspeed_strategy as code

    monkeypatch.setattr(code.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"grpo-lightning\[deepspeed\]"):
        code.GRPODeepSpeedStrategy(stage=3)


# ------------------------------------------------------------------------ FSDP1 block policy
def test_transformer_block_policy_wraps_each_decoder_layer_of_any_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_lightning.module.sharding import TransformerBlockPolicy
    from tests.helpers import make_model_dir

    policy = AutoModelForCausalLM.from_pretrained(make_model_dir(tmp_path / "m"))
    reference = AutoModelForCausalLM.from_pretrained(make_model_dir(tmp_path / "m"))
    root = torch.nn.ModuleDict({"policy": policy, "reference": reference})  # as Lightning wraps the whole module
    wrapped = TransformerBlockPolicy()._run_policy(root, set(), {"sharding_strategy": "x"})
    layers = [m for m in root.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert len(layers) == 2 * policy.config.num_hidden_layers
    assert set(map(id, wrapped)) == set(map(id, layers))  # each block (FSDP wraps the root itself)
    assert all(kwargs == {"sharding_strategy": "x"} for kwargs in wrapped.values())
    with pytest.raises(ValueError, match="auto_wrap_policy"):
        TransformerBlockPolicy()._run_policy(torch.nn.Linear(2, 2), set(), {})


# ------------------------------------------------------------------- refusals at setup
def _trainer(strategy, *, sampler=None, world_size=1, accumulate=2):
    return SimpleNamespace(strategy=strategy, datamodule=SimpleNamespace(sampler=sampler), world_size=world_size,
                           accumulate_grad_batches=accumulate)


def test_fsdp1_with_a_vllm_sampler_is_refused():
    from lightning.pytorch.strategies import FSDPStrategy

    from grpo_lightning.module.deepspeed_steps import check_strategy_setup

    with pytest.raises(ConfigError, match="ModelParallelStrategy"):
        check_strategy_setup(_trainer(FSDPStrategy(), sampler=SimpleNamespace(keeps_own_weights=True)), adapters=False)
    check_strategy_setup(_trainer(FSDPStrategy(), sampler=SimpleNamespace(keeps_own_weights=False)), adapters=False)
    check_strategy_setup(_trainer("ddp-like object"), adapters=True)  # nothing to check


@needs_deepspeed
def test_lightnings_plain_deepspeed_strategy_is_refused_with_the_fix():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from grpo_lightning.module.deepspeed_steps import check_strategy_setup

    with pytest.raises(ConfigError, match=r"trainer.accumulate_grad_batches=4.*GRPODeepSpeedStrategy.*deepspeed_zero3"):
        check_strategy_setup(_trainer(DeepSpeedStrategy(stage=3), accumulate=4), adapters=False)


@needs_deepspeed
def test_zero3_refusals_adapters_and_sharded_generation_out_of_step():
    from grpo_lightning.module.deepspeed_steps import check_strategy_setup
    from grpo_lightning.module.deepspeed_strategy import GRPODeepSpeedStrategy
    from grpo_lightning.samplers import HFGenerateSampler
    from grpo_lightning.samplers.fast_generate import FastGenerateSampler

    zero3, zero2 = GRPODeepSpeedStrategy(stage=3), GRPODeepSpeedStrategy(stage=2)
    with pytest.raises(ConfigError, match="peft_config.*ZeRO-2"):
        check_strategy_setup(_trainer(zero3), adapters=True)
    check_strategy_setup(_trainer(zero2), adapters=True)
    sharded = GRPODeepSpeedStrategy(stage=3, ds3_gather_for_generation=False)
    fast, hf = FastGenerateSampler(), HFGenerateSampler()
    with pytest.raises(ConfigError, match="ds3_gather_for_generation.*hf_generate"):
        check_strategy_setup(_trainer(sharded, sampler=fast, world_size=2), adapters=False)
    check_strategy_setup(_trainer(sharded, sampler=hf, world_size=2), adapters=False)  # generate(synced_gpus)
    check_strategy_setup(_trainer(sharded, sampler=fast, world_size=1), adapters=False)  # no peer to wait for
    check_strategy_setup(_trainer(zero3, sampler=fast, world_size=2), adapters=False)  # gathered: no collectives


def test_an_epoch_must_hold_whole_accumulation_windows_under_deepspeed():
    from grpo_lightning.module.deepspeed_strategy import check_whole_windows

    def trainer(batches, accumulate):
        return SimpleNamespace(accumulate_grad_batches=accumulate, num_training_batches=batches,
                               fit_loop=SimpleNamespace(setup_data=lambda: None))

    with pytest.raises(ConfigError, match=r"trainer.accumulate_grad_batches=4 does not divide an epoch's 6"):
        check_whole_windows(trainer(6, 4))
    check_whole_windows(trainer(8, 4))
    check_whole_windows(trainer(7, 1))
    check_whole_windows(trainer(float("inf"), 4))


@needs_deepspeed
def test_which_strategies_make_the_policy_use_its_plain_forward():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from grpo_lightning.module.deepspeed_strategy import GRPODeepSpeedStrategy
    from grpo_lightning.module.sharding import plain_forward_reason

    assert plain_forward_reason(FSDPStrategy()) == "FSDP"
    assert plain_forward_reason(GRPODeepSpeedStrategy(stage=3)) is None  # the head runs as its module's forward
    assert plain_forward_reason(GRPODeepSpeedStrategy(stage=2)) is None  # whole weights: the fast paths stay
    assert plain_forward_reason(DDPStrategy()) is None and plain_forward_reason(None) is None

"""configs/agents/ trained through ``grpo fit`` on CPU: a tiny model, and a scripted policy that
emits tool calls in place of the hub model's sampling (the tiny model scores and trains on them).
The step metrics show tool calls, and the training batches' loss mask excludes the tool results."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from grpo_lightning.cli import run_cli

REPO = Path(__file__).resolve().parents[2]


class RecordAgentBatches(pl.Callback):
    """Keeps every training micro-batch and the step metrics (class-level: built from YAML)."""

    batches: list = []
    metrics: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        RecordAgentBatches.batches.append(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        RecordAgentBatches.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def tiny_model(path: Path) -> str:
    from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm

    tokenizer = build_char_tokenizer()  # every printable character: tool-call JSON fits
    build_tiny_causal_lm(len(tokenizer), max_position_embeddings=512).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def fit(config: str, policy: str, tmp_path: Path, *extra: str):
    RecordAgentBatches.batches, RecordAgentBatches.metrics = [], []
    return run_cli([
        "fit", "--config", f"configs/agents/{config}", "--model.model", tiny_model(tmp_path / "model"),
        "--data.sampler", "tests.agents.scripted.ScriptedSampler", "--data.sampler.script", f"tests.agents.policies.{policy}",
        "--trainer.max_steps", "2", "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
        "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
        "--model.save_final_model", "false", "--trainer.callbacks+=tests.agents.test_agent_fit.RecordAgentBatches",
        *extra,
    ])


def check_tool_tokens_out_of_the_loss(tokenizer, tool_text: str) -> None:
    assert RecordAgentBatches.batches
    for batch in RecordAgentBatches.batches:
        assert batch.tool_mask is not None
        tools = (batch.tool_mask == 0) & batch.completion_mask.bool()
        assert tools.any(), "no tool-result tokens in a batch"
        assert not (batch.loss_mask.bool() & tools).any()  # tool results: attended to, never trained on
        assert (batch.loss_mask.sum(1) > 0).all()
        first = batch.completion_ids[0][tools[0]].tolist()
        assert tool_text in tokenizer.decode(first)


@pytest.mark.slow
def test_calculator_recipe_trains_with_tool_calls(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cli = fit("calculator_arithmetic.yaml", "calculator_policy", tmp_path, "--data.generation.max_completion_length", "128")
    assert cli.trainer.global_step == 2
    step = RecordAgentBatches.metrics[-1]
    assert step["tools/call_frequency"] == 1.0 and step["tools/failure_frequency"] == 0.0
    assert step["rewards/exact_match_reward/mean"] == 0.5  # even rows answer the tool's sum, odd rows add one
    check_tool_tokens_out_of_the_loss(cli.datamodule.sampler.handle.tokenizer, "<|tool|>")


@pytest.mark.slow
def test_increment_env_recipe_trains_without_a_dataset(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cli = fit("increment_env.yaml", "increment_policy", tmp_path)
    assert cli.trainer.global_step == 2
    step = RecordAgentBatches.metrics[-1]
    assert step["tools/call_frequency"] == 1.0 and step["rewards/IncrementEnv/mean"] == 0.5
    check_tool_tokens_out_of_the_loss(cli.datamodule.sampler.handle.tokenizer, "<|tool|>")


def test_environment_prompts_need_max_steps(tmp_path, monkeypatch):
    from grpo_lightning.errors import ConfigError

    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="set trainer.max_steps"):
        fit("increment_env.yaml", "increment_policy", tmp_path, "--trainer.max_steps", "-1", "--trainer.max_epochs", "1")


@pytest.mark.slow
def test_qwen3_gpu_recipe_trains_on_cpu_with_a_tiny_model(tmp_path, monkeypatch):
    from grpo_lightning.data import prompt_sets
    from tests.test_configs import offline_hub

    monkeypatch.setattr(prompt_sets, "load_prompt_dataset", offline_hub(tmp_path))
    monkeypatch.chdir(REPO)
    cli = fit("qwen3-0.6b_tools.yaml", "calculator_policy", tmp_path, "--trainer.max_steps", "1",
              "--data.per_device_train_batch_size", "8", "--data.generation.max_completion_length", "128",
              "--data.agent.parser", "qwen3", "--model.gradient_checkpointing", "false")
    assert cli.trainer.global_step == 1
    assert RecordAgentBatches.metrics[-1]["tools/call_frequency"] == 1.0

"""The worked examples in the top-level ``callbacks/`` folder: each callback's logic on hand-made
step sequences (fast), and all three registered from ``configs/examples/user_callbacks.yaml``
through the ``grpo`` console script run from the repository root (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from callbacks import RolloutsToParquet, SaveBestPolicy, StopWhenRewardReached
from grpo_lightning.types import CompletionTable

REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / "configs" / "examples" / "user_callbacks.yaml"


class FakeStrategy:
    def reduce_boolean_decision(self, decision, all=True):
        return decision

    def broadcast(self, obj, src=0):
        return obj

    def barrier(self):
        pass


def _trainer(root: Path | str = ".", **kwargs):
    return SimpleNamespace(global_step=0, should_stop=False, strategy=FakeStrategy(), is_global_zero=True,
                           default_root_dir=str(root), sanity_checking=False, callback_metrics={}, **kwargs)


def _stop_step(callback: StopWhenRewardReached, rewards: list[float], accumulation: int = 1) -> int | None:
    trainer, module = _trainer(), SimpleNamespace(step_metrics={})
    for step, reward in enumerate(rewards, start=1):
        trainer.global_step, module.step_metrics = step, {"reward": reward}
        for _ in range(accumulation):  # on_train_batch_end after every micro-batch
            callback.on_train_batch_end(trainer, module, None, None, 0)
        if trainer.should_stop:
            return step
    return None


def test_stop_when_the_windowed_mean_reaches_the_threshold():
    rewards = [1.0, 0.0, 0.5, 1.0, 0.75, 0.75, 1.0, 1.0]  # means of 3 from step 3: .5 .5 .75 .83 .83 .92
    assert _stop_step(StopWhenRewardReached(threshold=0.75, window=3), rewards) == 5  # reached exactly
    assert _stop_step(StopWhenRewardReached(threshold=0.8, window=3), rewards) == 6
    assert _stop_step(StopWhenRewardReached(threshold=0.8, window=3), rewards, accumulation=2) == 6
    assert _stop_step(StopWhenRewardReached(threshold=0.9, window=1), rewards) == 1  # a window of one step
    assert _stop_step(StopWhenRewardReached(threshold=1.5, window=3), rewards) is None
    resumed = StopWhenRewardReached(threshold=0.75, window=3)  # resumed after step 4: the window continues
    first = StopWhenRewardReached(threshold=0.75, window=3)
    assert _stop_step(first, rewards[:4]) is None
    resumed.load_state_dict(first.state_dict())
    trainer, module = _trainer(), SimpleNamespace(step_metrics={"reward": rewards[4]})
    trainer.global_step = 5
    resumed.on_train_batch_end(trainer, module, None, None, 0)
    assert trainer.should_stop and resumed.stopped_at_step == 5
    with pytest.raises(KeyError, match="metric='eval_reward' is not a step metric; choose one of \\['reward'\\]"):
        _stop_step(StopWhenRewardReached(threshold=0.0, metric="eval_reward"), [1.0])
    with pytest.raises(ValueError, match="window=0"):
        StopWhenRewardReached(threshold=1.0, window=0)


def test_save_best_policy_keeps_only_the_best_export(tmp_path):
    exports = []

    def export(directory):
        os.makedirs(directory, exist_ok=True)
        Path(directory, "weights.txt").write_text(str(trainer.global_step))
        exports.append(trainer.global_step)

    trainer, module = _trainer(tmp_path), SimpleNamespace(export=export)
    callback = SaveBestPolicy(monitor="eval_reward")
    for step, value in [(2, 0.2), (4, 0.5), (6, 0.4), (8, 0.7), (10, 0.7)]:
        trainer.global_step, trainer.callback_metrics = step, {"eval_reward": torch.tensor(value), "reward": 0.0}
        callback.on_validation_end(trainer, module)
    assert exports == [2, 4, 8]  # improvements only; a tie is not one
    best = tmp_path / "best_model"
    assert (best / "weights.txt").read_text() == "8" and not (tmp_path / "best_model.partial").exists()
    assert json.loads((best / "best.json").read_text()) == {"step": 8, "value": pytest.approx(0.7), "monitor": "eval_reward"}
    lowest = SaveBestPolicy(monitor="eval_loss", mode="min", dirpath=str(tmp_path / "low"))
    exports.clear()
    for step, value in [(1, 3.0), (2, 2.0), (3, 2.5)]:
        trainer.global_step, trainer.callback_metrics = step, {"eval_loss": value}
        lowest.on_validation_end(trainer, module)
    assert exports == [1, 2] and lowest.state_dict() == {"best_value": 2.0, "best_step": 2}
    with pytest.raises(KeyError, match="monitor='eval_acc' was not logged .*\\['eval_loss'\\]"):
        SaveBestPolicy(monitor="eval_acc").on_validation_end(trainer, module)


def test_rollouts_to_parquet_writes_each_generation_batch_once(tmp_path):
    import pandas as pd

    def table(step, n):
        return CompletionTable(step=step, columns={"prompt": [f"p{step}"] * n, "completion": ["c"] * n,
                                                   "reward/length": [float(i) for i in range(n)],
                                                   "advantage": [0.5] * n})

    datamodule = SimpleNamespace(collect_completions=False, completion_table=None)
    trainer = _trainer(tmp_path, datamodule=datamodule)
    callback = RolloutsToParquet()
    callback.setup(trainer, None, "fit")
    assert datamodule.collect_completions
    for step, current in [(1, table(0, 4)), (2, None), (2, table(1, 4)), (3, None), (3, table(2, 3))]:
        if current is not None:
            datamodule.completion_table = current
        trainer.global_step = step  # the same table seen again after a later micro-batch is not rewritten
        callback.on_train_batch_end(trainer, None, None, None, 0)
        callback.on_train_batch_end(trainer, None, None, None, 0)
    files = sorted(p.name for p in (tmp_path / "rollouts").iterdir())
    assert files == ["rollouts_000000_step000000.parquet", "rollouts_000001_step000001.parquet",
                     "rollouts_000002_step000002.parquet"]
    frame = pd.read_parquet(tmp_path / "rollouts")
    assert list(frame.columns) == ["step", "prompt", "completion", "reward/length", "advantage"]
    assert sorted(frame["step"]) == [0] * 4 + [1] * 4 + [2] * 3 and callback.state_dict() == {"files_written": 3}


def _history(root: Path, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    return {m.step: m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp)}


@pytest.mark.slow
def test_the_examples_run_from_yaml_with_the_grpo_command(tmp_path):
    """The quickstart plus the overlay, a tiny model and a length reward swapped in, run by the
    ``grpo`` console script from the repository root (the ``callbacks`` package imports from the
    working directory). Stop: at the first step whose 10-step mean reward is >= 0.9. Best
    policy: the checkpointed policy of the step with the highest eval_reward, loadable by
    transformers. Parquet: every generation batch, matching the logged reward of its step."""
    import pandas as pd
    from transformers import AutoModelForCausalLM

    from tests.helpers import make_model_dir, write_prompts

    root = tmp_path / "run"
    grpo = Path(sys.executable).with_name("grpo")
    command = [str(grpo), "fit", "--config", "configs/quickstart.yaml", "--config", str(OVERLAY.relative_to(REPO)),
               "--model.model", make_model_dir(tmp_path / "model"), "--data.reward_funcs", "[tests.helpers.length_reward]",
               "--data.dataset", write_prompts(tmp_path / "train.jsonl", 64),
               "--data.eval_dataset", write_prompts(tmp_path / "eval.jsonl", 4),
               "--data.per_device_train_batch_size", "8", "--data.num_generations", "4",
               "--data.per_device_eval_batch_size", "8", "--data.num_generations_eval", "4",
               "--trainer.max_steps", "30", "--trainer.val_check_interval", "3", "--trainer.log_every_n_steps", "1",
               "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
               "--checkpoint_every_n_steps", "1", "--keep_checkpoints", "30", "--memory_plan", "false"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]

    rewards = _history(root, "reward")
    means = {s: sum(rewards[s - k] for k in range(10)) / 10 for s in rewards if s >= 10}
    stop = min(s for s, mean in means.items() if mean >= 0.9)
    assert max(rewards) == stop < 30, (stop, rewards)

    evals = _history(root, "eval_reward")
    best_step = max(evals, key=lambda s: (evals[s], -s))  # the first of the highest
    best = root / "best_model"
    assert json.loads((best / "best.json").read_text())["step"] == best_step
    saved = AutoModelForCausalLM.from_pretrained(best).state_dict()
    checkpoint = torch.load(root / "checkpoints" / f"step={best_step:07d}.ckpt", weights_only=False)["state_dict"]
    for name, value in saved.items():
        assert torch.equal(value, checkpoint[f"policy.{name}"]), name

    frame = pd.read_parquet(root / "rollouts")
    assert {"step", "prompt", "completion", "reward/length_reward", "advantage"} <= set(frame.columns)
    assert sorted(frame["step"].unique()) == list(range(stop)) and len(frame) == 8 * stop
    for step, rows in frame.groupby("step"):  # trained on at optimizer step step + 1, logged there
        assert rows["reward/length_reward"].mean() == pytest.approx(rewards[step + 1], rel=1e-6)


def test_the_overlay_parses_on_the_quickstart_and_names_the_three_examples(monkeypatch):
    from grpo_lightning.cli import TRAINER_DEFAULTS, GRPOLightningCLI
    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule

    class ParseOnly(GRPOLightningCLI):
        def instantiate_classes(self) -> None:
            pass

    monkeypatch.chdir(REPO)
    cli = ParseOnly(GRPOModule, RolloutDataModule, trainer_defaults=TRAINER_DEFAULTS, run=False,
                    args=["--config", "configs/quickstart.yaml", "--config", str(OVERLAY)])
    names = [c.class_path for c in cli.config.trainer.callbacks]
    assert names == ["callbacks.StopWhenRewardReached", "callbacks.SaveBestPolicy", "callbacks.RolloutsToParquet"]
    assert cli.config.data.eval_dataset == "examples/arithmetic/test.jsonl"

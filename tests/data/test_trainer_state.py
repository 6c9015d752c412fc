"""Reward functions get TRL's ``trainer_state`` fields during a real tiny fit (training and evaluation)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.data.prompt_order import data_seed
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams, TrainerState
from tests.helpers import make_model_dir, write_prompts


def test_data_seed_defaults_to_the_global_seed(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert data_seed(None) == 42 and data_seed(5) == 5
    pl.seed_everything(123)
    assert data_seed(None) == 123 and data_seed(5) == 5


@pytest.mark.slow
def test_reward_functions_read_trainer_state_during_fit(tmp_path, monkeypatch: pytest.MonkeyPatch):
    seen: list[tuple] = []

    def progress_reward(completions, trainer_state, **kwargs):
        assert isinstance(trainer_state, TrainerState)
        s = trainer_state
        seen.append((s.trainer.validating, s.global_step, s.epoch, s.max_steps, s.num_train_epochs,
                     s.is_world_process_zero, s.trainer.current_epoch))
        return [float(len(c)) for c in completions]

    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored after the test
    pl.seed_everything(7)
    module = GRPOModule(make_model_dir(tmp_path / "model"), learning_rate=1e-2, save_final_model=False)
    data = RolloutDataModule(
        write_prompts(tmp_path / "p.jsonl", num_rows=8), reward_funcs=[progress_reward], num_generations=4,
        per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=3),
        eval_dataset=write_prompts(tmp_path / "e.jsonl", num_rows=2), num_generations_eval=2,
        per_device_eval_batch_size=4,
    )  # 2 prompts per step: 4 optimizer steps per epoch
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path),
    )
    assert trainer.max_steps == -1  # the plan comes from max_epochs
    trainer.fit(module, data)
    assert data.prompt_order.seed == 7  # data.seed unset: the global seed orders the prompts
    train = [s[1:] for s in seen if not s[0]]
    assert train == [(step, step / 4, 8, 2, True, step // 4) for step in range(8)]
    evals = [s[1:] for s in seen if s[0]]  # after each epoch: 4 and 8 micro-steps done
    assert evals == [(4, 1.0, 8, 2, True, 0), (8, 2.0, 8, 2, True, 1)]

"""``GRPOTrainer`` runs against transformers' flow: ``state.max_steps`` / ``num_train_epochs`` when
epochs bound the run, the end-of-training summary (``on_log``, speed metrics, ``total_flos``), step
logs at multiples of ``logging_steps`` only (the window carried over), and the final evaluation of
``eval_strategy="steps"``."""

from __future__ import annotations

import datasets
import pytest

from grpo_lightning import GRPOConfig, GRPOTrainer
from tests.trl_compat.rewards import length_reward


class Events:
    """A duck-typed HF callback: (event, global_step) of each event, the state at on_train_begin,
    each on_log's logs."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.logs: list[dict] = []
        self.at_begin: tuple[int, float] | None = None

    def on_train_begin(self, args, state, control, **kw):
        self.at_begin = (state.max_steps, state.num_train_epochs)

    def on_log(self, args, state, control, logs=None, **kw):
        self.events.append(("on_log", state.global_step))
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, **kw):
        self.events.append(("on_evaluate", state.global_step))

    def on_train_end(self, args, state, control, **kw):
        self.events.append(("on_train_end", state.global_step))


def _four_prompts():
    return datasets.Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(4)])


def _args(tmp_path, **kw):
    return GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=4,
                      max_completion_length=4, bf16=False, save_strategy="no", disable_tqdm=True, **kw)


@pytest.mark.slow
def test_epoch_bound_run_state_summary_and_step_logs(tiny_model, tmp_path):
    events = Events()
    # 4 prompts x 4 completions / 4 per micro-batch: 4 optimizer steps an epoch, 8 in all
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=_four_prompts(),
                          args=_args(tmp_path, max_steps=-1, num_train_epochs=2, logging_steps=3), callbacks=[events])
    output = trainer.train()

    assert events.at_begin == (8, 2)  # the steps the epochs amount to, HF's whole epochs
    assert (trainer.state.max_steps, trainer.state.num_train_epochs, trainer.state.global_step) == (8, 2, 8)
    assert trainer.state.log_history is trainer.log_history

    # step logs at 3 and 6 only: none at the first epoch's end (step 4) or at the last step (8)
    steps = [e for e in trainer.log_history if "loss" in e]
    assert [e["step"] for e in steps] == [3, 6]
    step_rewards = [e["reward"] for e in trainer.log_history if "reward" in e]
    summary = trainer.log_history[-1]
    assert list(summary)[:5] == ["train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                                 "train_loss"]
    assert summary["total_flos"] == 0.0 and summary["step"] == 8 and summary["epoch"] == 2.0
    # HF's samples: the dataset's rows x num_train_epochs (8) over the runtime; 8 steps likewise
    assert summary["train_samples_per_second"] == pytest.approx(8 / summary["train_runtime"], rel=0.01)
    assert summary["train_steps_per_second"] == pytest.approx(8 / summary["train_runtime"], rel=0.01)
    # the window of steps 7-8 goes into the summary (TRL's log averages it in); the step-log-only keys do not
    assert "reward" in summary and "loss" not in summary and "grad_norm" not in summary
    assert len(step_rewards) == 3
    # the summary is logged (on_log) before on_train_end, as HF's _finalize_training
    assert events.events[-2:] == [("on_log", 8), ("on_train_end", 8)]
    assert events.logs[-1] == {k: v for k, v in summary.items() if k != "step"}
    assert output.metrics == events.logs[-1]
    assert {"train_samples_per_second", "total_flos", "train_loss", "epoch"} <= set(output.metrics)


@pytest.mark.slow
def test_a_fractional_logging_steps_in_an_epoch_run_is_a_fraction_of_its_planned_steps(tiny_model, tmp_path):
    """transformers: ``logging_steps < 1`` logs every ``ceil(max_steps x logging_steps)`` steps, with
    ``max_steps`` what the epochs amount to (8 here: every 2 steps)."""
    events = Events()
    args = _args(tmp_path, max_steps=-1, num_train_epochs=2, logging_steps=0.25)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=_four_prompts(), args=args,
                          callbacks=[events])
    trainer.train()
    assert [e["step"] for e in trainer.log_history if "loss" in e] == [2, 4, 6, 8]
    assert trainer.state.logging_steps == 2


@pytest.mark.slow
def test_steps_evaluation_runs_again_at_a_last_step_that_is_not_an_eval_step(tiny_model, tmp_path):
    events = Events()
    args = _args(tmp_path, max_steps=3, logging_steps=2, eval_strategy="steps", eval_steps=2,
                 per_device_eval_batch_size=4)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=_four_prompts(),
                          eval_dataset=_four_prompts(), args=args, callbacks=[events])
    trainer.train()
    assert [s for name, s in events.events if name == "on_evaluate"] == [2, 3]  # step 2, then the last step
    assert [e["step"] for e in trainer.log_history if "eval_reward" in e] == [2, 3]
    assert [e["step"] for e in trainer.log_history if "loss" in e] == [2]  # no step log at the stop (step 3)
    assert trainer.state.max_steps == 3 and trainer.log_history[-1]["step"] == 3


@pytest.mark.slow
def test_fractional_eval_and_save_steps_in_an_epoch_run_are_fractions_of_its_planned_steps(tiny_model, tmp_path):
    """transformers resolves ``eval_steps`` and ``save_steps`` below 1 against the steps the epochs
    amount to (8 here): evaluations every 4 steps, checkpoints every 2."""
    events = Events()
    args = _args(tmp_path, max_steps=-1, num_train_epochs=2, logging_steps=4, eval_strategy="steps", eval_steps=0.5,
                 per_device_eval_batch_size=4)
    args.save_strategy, args.save_steps, args.save_total_limit = "steps", 0.25, 10
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=_four_prompts(),
                          eval_dataset=_four_prompts(), args=args, callbacks=[events])
    trainer.train()
    assert [s for name, s in events.events if name == "on_evaluate"] == [4, 8]
    saved = sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step=*.ckpt"))
    assert saved == [f"step={step:07d}.ckpt" for step in (2, 4, 6, 8)]
    assert (trainer.state.eval_steps, trainer.state.save_steps) == (4, 2)


@pytest.mark.slow
def test_train_resumes_from_the_last_checkpoint_with_transformers_state(tiny_model, tmp_path):
    """``train(resume_from_checkpoint=True)`` continues from the newest checkpoint: the state starts
    at its step and (fractional) epoch, as transformers restores them, and the run ends at max_steps."""

    class Begin:
        def on_train_begin(self, args, state, control, **kw):
            self.at = (state.global_step, state.epoch)

    args = _args(tmp_path, max_steps=2, logging_steps=1)
    args.save_strategy, args.save_steps = "steps", 1
    GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=_four_prompts(), args=args).train()
    args = _args(tmp_path, max_steps=3, logging_steps=1)
    args.save_strategy, args.save_steps = "steps", 1
    begin = Begin()
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=_four_prompts(), args=args,
                          callbacks=[begin])
    trainer.train(resume_from_checkpoint=True)
    assert begin.at == (2, 0.5)  # 4 optimizer steps an epoch
    assert trainer.state.global_step == 3
    assert [e["step"] for e in trainer.log_history if "loss" in e] == [1, 2, 3]  # restored, as HF's trainer_state.json

"""A step's metrics are logged before its checkpoint is written, and the metrics not yet logged
travel in the checkpoint: a resumed run logs what one that never stopped logs."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.metrics import TrainingMetrics
from grpo_lightning.types import GenerationParams, MetricValue
from tests.helpers import MemoryLogger, length_reward, make_model_dir, write_prompts


class CheckpointSeesLoggedSteps(ModelCheckpoint):
    """Records, at each save, the steps the logger already holds."""

    def __init__(self, logger: MemoryLogger, **kwargs) -> None:
        super().__init__(**kwargs)
        self.memory, self.seen = logger, []

    def _save_checkpoint(self, trainer, filepath):
        self.seen.append((trainer.global_step, [step for step, _ in self.memory.rows]))
        super()._save_checkpoint(trainer, filepath)


def _fit(tmp_path, *, max_steps, log_every, ckpt_path=None, lr_scheduler_type="constant", num_rows=24):
    tmp_path.mkdir(exist_ok=True)
    logger = MemoryLogger()
    checkpoint = CheckpointSeesLoggedSteps(logger, dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1,
                                           filename="{step}")
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=logger, log_every_n_steps=log_every,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint])
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl", num_rows=num_rows), reward_funcs=[length_reward],
                             num_generations=4, per_device_train_batch_size=8, seed=3,
                             generation=GenerationParams(max_completion_length=4))
    pl.seed_everything(0)
    # constant: the run stopped at step 3 follows the same schedule as the one that goes on to 4
    module = GRPOModule(make_model_dir(tmp_path / "m"), learning_rate=1e-2, lr_scheduler_type=lr_scheduler_type,
                        save_final_model=False)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return logger, checkpoint


def test_a_step_is_logged_before_its_checkpoint(tmp_path):
    logger, checkpoint = _fit(tmp_path, max_steps=3, log_every=1)
    assert [(step, logged) for step, logged in checkpoint.seen] == [(1, [1]), (2, [1, 2]), (3, [1, 2, 3])]


def test_a_resume_between_two_logs_logs_the_same_averages(tmp_path):
    straight, _ = _fit(tmp_path / "a", max_steps=4, log_every=2)
    _fit(tmp_path / "b", max_steps=3, log_every=2)  # its step-3 checkpoint holds step 3's unlogged metrics
    resumed, _ = _fit(tmp_path / "b", max_steps=4, log_every=2, ckpt_path=str(tmp_path / "b" / "ckpt" / "step=3.ckpt"))
    want = dict(straight.rows)[4]
    got = dict(resumed.rows)[4]
    assert got.keys() == want.keys()
    for name, value in want.items():
        if name == "step_time":  # wall time: differs from run to run
            continue
        assert got[name] == value, (name, {k: (got[k], v) for k, v in want.items() if got[k] != v})


def test_a_resume_from_an_epochs_last_step_logs_the_same_averages(tmp_path):
    """3-step epochs, a log every 2 steps: step 3 ends an epoch, which logs what is left of its
    window before the step's checkpoint is written; the resumed run does not log step 3 again
    inside step 4's average."""
    straight, _ = _fit(tmp_path / "a", max_steps=4, log_every=2, num_rows=6)
    _fit(tmp_path / "b", max_steps=3, log_every=2, num_rows=6)
    resumed, _ = _fit(tmp_path / "b", max_steps=4, log_every=2, num_rows=6,
                      ckpt_path=str(tmp_path / "b" / "ckpt" / "step=3.ckpt"))
    assert [step for step, _ in straight.rows] == [2, 3, 4]
    want, got = dict(straight.rows)[4], dict(resumed.rows)[4]
    assert {k: v for k, v in got.items() if k != "step_time"} == {k: v for k, v in want.items() if k != "step_time"}


def test_a_log_holds_the_last_steps_grad_norm_and_learning_rate_and_the_mean_loss(tmp_path):
    """As the HF Trainer logs them: ``grad_norm`` and ``learning_rate`` of the last step since the
    previous log (a linear schedule makes the rates differ), ``loss`` the mean over those steps,
    ``epoch`` fractional."""
    every, _ = _fit(tmp_path / "a", max_steps=2, log_every=1, lr_scheduler_type="linear")
    second, _ = _fit(tmp_path / "b", max_steps=2, log_every=2, lr_scheduler_type="linear")
    by_step, logged = dict(every.rows), dict(second.rows)[2]
    assert by_step[1]["learning_rate"] != by_step[2]["learning_rate"]
    assert logged["grad_norm"] == by_step[2]["grad_norm"]
    assert logged["learning_rate"] == by_step[2]["learning_rate"]
    assert logged["loss"] == (by_step[1]["loss"] + by_step[2]["loss"]) / 2
    # HF's fractional epoch: batch k of an epoch of n batches logs epoch (k + 1) / n
    assert 0 < by_step[1]["epoch"] < 1 or by_step[1]["epoch"] == 1.0
    assert by_step[2]["epoch"] == 2 * by_step[1]["epoch"] == logged["epoch"]


def test_eval_loss_is_a_mean_over_rows_not_over_validation_steps(tmp_path):
    """HF's ``eval_loss`` weighs each evaluation step by its rows: 5 prompts in steps of 2 prompts
    leave a last step of half the rows, which counts half as much."""
    import math

    from grpo_lightning.module.metrics import MetricsWindow

    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, seed=3, generation=GenerationParams(max_completion_length=4),
                             eval_dataset=write_prompts(tmp_path / "eval.jsonl", num_rows=5),
                             per_device_eval_batch_size=4, num_generations_eval=2)
    module = GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False)
    steps: list[tuple[float, int]] = []  # (loss, rows) of each validation step
    policy_loss = module._policy_loss

    def recording_policy_loss(batch, totals):
        out = policy_loss(batch, totals)
        steps.append((float(out.loss), len(batch)))
        return out

    module._policy_loss = recording_policy_loss
    trainer = pl.Trainer(accelerator="cpu", logger=MemoryLogger(), enable_progress_bar=False,
                         enable_model_summary=False)
    (results,) = trainer.validate(module, data, verbose=False)
    assert [rows for _, rows in steps] == [4, 4, 2]
    per_row = sum(loss * rows for loss, rows in steps) / sum(rows for _, rows in steps)
    per_step = sum(loss for loss, _ in steps) / len(steps)
    assert not math.isclose(per_row, per_step, rel_tol=1e-6)  # the test tells the two apart
    assert math.isclose(results["eval_loss"], per_row, rel_tol=1e-6)

    window = MetricsWindow()  # a checkpoint written before values carried weights still loads
    window.load_state_dict({"values": {"loss": [1.0, 4.0]}, "latest": {}})
    window.add({"loss": 7.0}, weight=2.0)
    assert window.flush() == {"loss": (1.0 + 4.0 + 14.0) / 4}


def test_a_checkpoint_inside_an_optimizer_step_holds_the_log_window_as_that_step_started():
    """Written inside an accumulation window, the checkpoint's log window leaves out that window's
    values (its micro-steps are trained again after the resume); at a step's end it holds all."""
    metrics = TrainingMetrics()
    metrics.add({"reward": 1.0, "num_tokens": 10.0})
    metrics.add_micro_step({"clip_ratio": MetricValue(torch.tensor(0.5), torch.tensor(1.0), "mean")}, None)
    metrics.close_step({"loss": 0.25})
    at_step_end = metrics.state_dict()
    metrics.add({"reward": 3.0, "num_tokens": 20.0})  # the next step's generation, then a failure
    metrics.add_micro_step({"clip_ratio": MetricValue(torch.tensor(0.1), torch.tensor(1.0), "mean")}, None)
    assert metrics.state_dict() == at_step_end
    assert at_step_end["log"]["values"] == {"reward": [1.0], "clip_ratio": [0.5], "loss": [0.25]}
    assert at_step_end["log"]["latest"] == {"num_tokens": 10.0}

    resumed = TrainingMetrics()
    resumed.load_state_dict(at_step_end)
    resumed.add({"reward": 3.0, "num_tokens": 20.0})  # the window trained again
    resumed.close_step({"loss": 0.75})
    assert resumed.flush_log() == {"reward": 2.0, "num_tokens": 20.0, "clip_ratio": 0.5, "loss": 0.5}


def test_a_logger_that_fails_leaves_the_metrics_gathered():
    """A tracking server's error while a step is logged: the metrics stay in the window (the
    ``on_exception`` checkpoint holds them) instead of being lost with the failed call."""
    from types import SimpleNamespace

    from grpo_lightning.module.step_logging import FlushStepLogs

    class Down(MemoryLogger):
        def log_metrics(self, metrics, step=None):
            raise ConnectionError("tracking server unavailable (simulated)")

    metrics = TrainingMetrics()
    metrics.add({"reward": 1.0})
    metrics.close_step({"loss": 0.5})
    before = metrics.state_dict()
    trainer = SimpleNamespace(loggers=[Down()], global_step=1)
    with pytest.raises(ConnectionError, match="simulated"):
        FlushStepLogs(metrics).flush(trainer, epoch=0.5)
    assert metrics.state_dict() == before and before["log"]["values"] == {"reward": [1.0], "loss": [0.5]}

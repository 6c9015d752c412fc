"""The run's checkpoints: one folder, defaults when none is configured, ``last`` that finds the
newest complete checkpoint, half-written checkpoints detected and skipped, a changed data plan
refused on resume."""

from __future__ import annotations

import json
import os
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.cli.checkpoints import (
    CheckpointOnException, checkpoint_dir, is_complete, place_checkpoints, read_run_record, resolve_ckpt_path, write_run_record,
)
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.errors import ConfigError
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import MemoryLogger, fit_config, length_reward, make_model_dir, write_config, write_prompts


def _save(path, step):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "weights": torch.randn(64)}, path)
    time.sleep(0.02)  # distinct modification times


def test_defaults_are_added_only_when_no_checkpoint_is_configured(tmp_path):
    added = place_checkpoints([], str(tmp_path), every_n_steps=7, keep=3)
    periodic, on_exception = added
    assert isinstance(periodic, ModelCheckpoint) and isinstance(on_exception, CheckpointOnException)
    assert periodic.dirpath == checkpoint_dir(str(tmp_path)) == os.path.dirname(on_exception.path)
    assert (periodic._every_n_train_steps, periodic.save_top_k, periodic.monitor, periodic.save_last) == (7, 3, "step", "link")
    mine = ModelCheckpoint(every_n_train_steps=1)
    elsewhere = ModelCheckpoint(dirpath=str(tmp_path / "mine"))
    assert place_checkpoints([mine, elsewhere], str(tmp_path), 7, 3) == [mine, elsewhere]
    assert mine.dirpath == checkpoint_dir(str(tmp_path)) and elsewhere.dirpath == str(tmp_path / "mine")
    with pytest.raises(ConfigError, match="keep_checkpoints=0"):
        place_checkpoints([], str(tmp_path), 5, 0)


def test_last_is_the_newest_complete_checkpoint(tmp_path):
    folder = tmp_path / "checkpoints"
    with pytest.raises(ConfigError, match=r"--ckpt_path last: no complete checkpoint in .*checkpoints"):
        resolve_ckpt_path("last", str(tmp_path))
    _save(folder / "step=0000003.ckpt", 3)
    _save(folder / "step=0000006.ckpt", 6)
    os.symlink("step=0000006.ckpt", folder / "last.ckpt")
    assert resolve_ckpt_path("last", str(tmp_path)) == str(folder / "step=0000006.ckpt")
    _save(folder / "on_exception.ckpt", 7)  # written when step 8 failed: the newest
    assert resolve_ckpt_path("last", str(tmp_path)) == str(folder / "on_exception.ckpt")
    assert resolve_ckpt_path(None, str(tmp_path)) is None and resolve_ckpt_path("best", str(tmp_path)) == "best"


def test_a_half_written_checkpoint_is_detected_and_the_previous_one_used(tmp_path, caplog):
    folder = tmp_path / "checkpoints"
    _save(folder / "step=0000003.ckpt", 3)
    _save(folder / "step=0000006.ckpt", 6)
    data = (folder / "step=0000006.ckpt").read_bytes()
    (folder / "step=0000006.ckpt").write_bytes(data[: len(data) // 2])  # killed while writing
    assert not is_complete(str(folder / "step=0000006.ckpt")) and is_complete(str(folder / "step=0000003.ckpt"))
    assert resolve_ckpt_path("last", str(tmp_path)) == str(folder / "step=0000003.ckpt")
    with caplog.at_level("WARNING", logger="grpo_lightning.cli.checkpoints"):
        chosen = resolve_ckpt_path(str(folder / "step=0000006.ckpt"), str(tmp_path))
    assert chosen == str(folder / "step=0000003.ckpt")
    assert "is incomplete (the run was stopped while writing it); resuming from" in caplog.text
    (folder / "step=0000003.ckpt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ConfigError, match="is incomplete .* no complete checkpoint is beside it"):
        resolve_ckpt_path(str(folder / "step=0000006.ckpt"), str(tmp_path))
    with pytest.raises(ConfigError, match="no such checkpoint"):
        resolve_ckpt_path(str(folder / "missing.ckpt"), str(tmp_path))


def test_the_run_record_round_trips(tmp_path):
    assert read_run_record(str(tmp_path)) is None
    write_run_record(str(tmp_path), "abc123", "sqlite:///x.db", "grpo")
    assert read_run_record(str(tmp_path)) == {"mlflow_run_id": "abc123", "tracking_uri": "sqlite:///x.db",
                                              "experiment_name": "grpo"}


def _fit(tmp_path, max_steps, per_device_train_batch_size=8, ckpt_path=None):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[checkpoint], default_root_dir=str(tmp_path))
    module = GRPOModule(make_model_dir(tmp_path / "m"), learning_rate=1e-2, save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=per_device_train_batch_size,
                             generation=GenerationParams(max_completion_length=4))
    trainer.fit(module, data, ckpt_path=ckpt_path)


@pytest.mark.slow
def test_a_resume_under_another_data_plan_is_refused_by_name(tmp_path):
    _fit(tmp_path, 1)
    with pytest.raises(ConfigError, match=r"per_device_train_batch_size: 8 in the checkpoint, 4 now.*original settings"):
        _fit(tmp_path, 2, per_device_train_batch_size=4, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=1.ckpt"))


def test_a_failing_run_leaves_a_checkpoint_that_last_resumes(tmp_path):
    """The exception checkpoint is written at the failure and is what ``--ckpt_path last`` picks."""

    class Boom(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                raise RuntimeError("out of memory (simulated)")

    callbacks = place_checkpoints([Boom()], str(tmp_path), every_n_steps=10, keep=2)
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, default_root_dir=str(tmp_path))
    module = GRPOModule(make_model_dir(tmp_path / "m"), learning_rate=1e-2, save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    with pytest.raises(RuntimeError, match="simulated"):
        trainer.fit(module, data)
    written = os.path.join(checkpoint_dir(str(tmp_path)), "on_exception.ckpt")
    assert resolve_ckpt_path("last", str(tmp_path)) == written
    assert torch.load(written, weights_only=False)["global_step"] == 2


def test_last_goes_by_step_not_by_write_time(tmp_path):
    """A copied run folder (``cp -r`` without ``-p``) has fresh, meaningless write times."""
    folder = tmp_path / "checkpoints"
    _save(folder / "step=0000008.ckpt", 8)
    _save(folder / "step=0000006.ckpt", 6)  # written later
    _save(folder / "on_exception.ckpt", 4)  # written last, at an earlier step
    assert resolve_ckpt_path("last", str(tmp_path)) == str(folder / "step=0000008.ckpt")


def _fit_with_default_checkpoints(root, max_steps, ckpt_path=None):
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root),
                         callbacks=place_checkpoints([], str(root), every_n_steps=1, keep=2))
    module = GRPOModule(make_model_dir(root / "m"), learning_rate=1e-2, save_final_model=False)
    data = RolloutDataModule(write_prompts(root / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    trainer.fit(module, data, ckpt_path=resolve_ckpt_path(ckpt_path, str(root)))


def test_a_resumed_run_links_last_to_its_newest_checkpoint(tmp_path):
    """Not to a versioned ``last-v1.ckpt`` beside a stale ``last.ckpt``; the checkpoint the run
    resumed from is kept besides the ``keep_checkpoints`` newest (Lightning never deletes it)."""
    _fit_with_default_checkpoints(tmp_path, 2)
    _fit_with_default_checkpoints(tmp_path, 4, "last")
    folder = checkpoint_dir(str(tmp_path))
    assert sorted(os.listdir(folder)) == ["last.ckpt", "step=0000002.ckpt", "step=0000003.ckpt", "step=0000004.ckpt"]
    assert os.readlink(os.path.join(folder, "last.ckpt")) == "step=0000004.ckpt"
    assert resolve_ckpt_path("last", str(tmp_path)) == os.path.join(folder, "step=0000004.ckpt")


def test_a_resume_continues_the_mlflow_run_of_a_configured_logger(tmp_path):
    """``trainer.logger: MLFlowLogger`` in the YAML (not the default logger): the resumed run logs
    into the run it resumes, not into a second one."""
    from mlflow.tracking import MlflowClient

    from grpo_lightning.cli import main

    store = f"sqlite:///{tmp_path}/mlflow.db"
    logger = {"class_path": "lightning.pytorch.loggers.MLFlowLogger",
              "init_args": {"experiment_name": "grpo", "tracking_uri": store}}
    path = write_config(tmp_path / "cfg.yaml", fit_config(
        tmp_path / "inputs", trainer={"default_root_dir": str(tmp_path), "log_every_n_steps": 1, "logger": logger},
        model={"learning_rate": 1e-2, "save_final_model": False}, checkpoint_every_n_steps=1))
    main(["fit", "--config", str(path), "--trainer.max_steps", "2"])
    main(["fit", "--config", str(path), "--trainer.max_steps", "3", "--ckpt_path", "last"])
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    assert len(runs) == 1
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")] == [1, 2, 3]


def fit_four_steps(root, inputs, record, *, reward=length_reward, module_class=GRPOModule, ckpt_path=None,
                   accumulate=1, steps_per_generation=None, val_check_interval=None, attention_dropout=0.0,
                   every_n_steps=10, callbacks=()):
    """Four seeded optimizer steps of a tiny model into ``root`` (``on_exception.ckpt`` on a failure,
    resumed from ``ckpt_path``), the model and prompts under ``inputs``; ``record`` (a
    :class:`StepRecord`) observes, logging every 3 steps; validating every ``val_check_interval``
    micro-steps when given; ``attention_dropout`` makes training draw random numbers."""
    validation = {} if val_check_interval is None else dict(val_check_interval=val_check_interval,
                                                           check_val_every_n_epoch=None, num_sanity_val_steps=0)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=record.logger, log_every_n_steps=3, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root), accumulate_grad_batches=accumulate,
                         callbacks=place_checkpoints([record, *callbacks], str(root), every_n_steps=every_n_steps, keep=4),
                         **validation)
    prompts = write_prompts(inputs / "p.jsonl")
    data = RolloutDataModule(prompts, reward_funcs=[reward], num_generations=4, per_device_train_batch_size=8, seed=1,
                             generation=GenerationParams(max_completion_length=6), steps_per_generation=steps_per_generation,
                             eval_dataset=None if val_check_interval is None else prompts, per_device_eval_batch_size=8)
    pl.seed_everything(0)
    model_dir = make_model_dir(inputs / "m")
    if attention_dropout:
        config = json.loads((inputs / "m" / "config.json").read_text())
        (inputs / "m" / "config.json").write_text(json.dumps({**config, "attention_dropout": attention_dropout}))
    trainer.fit(module_class(model_dir, learning_rate=5e-2, save_final_model=False), data,
                ckpt_path=resolve_ckpt_path(ckpt_path, str(root)))


class StepRecord(pl.Callback):
    """Each optimizer step's reward and loss, by step, and what the run logged (``logged``)."""

    def __init__(self):
        self.by_step, self.logger = {}, MemoryLogger()

    def logged(self, after_step=0):
        """The logged rows after ``after_step``, without wall times."""
        return [(step, {k: v for k, v in row.items() if "time" not in k}) for step, row in self.logger.rows
                if step > after_step]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return  # inside an accumulation window: no step was published
        metrics = pl_module.step_metrics
        self.by_step[trainer.global_step] = (metrics["reward"], metrics["loss"])


class FailOnce:
    """A length reward that raises once, at its ``fail_at``-th call (a judge that timed out)."""

    __name__ = "length_reward"

    def __init__(self, fail_at: int | None) -> None:
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, completions, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("judge unavailable (simulated)")
        return length_reward(completions, **kwargs)


def straight_and_resumed(fit, tmp_path, logged_after_step=2):
    """``fit(root, fail, ckpt_path) -> StepRecord`` three times: a run that never fails, one that
    fails ("simulated"), and its resume from ``last``. The resume trains steps 3 and 4 as the
    straight run does and logs what it logs after ``logged_after_step``; returns both records."""
    straight = fit(tmp_path / "straight", False, None)
    with pytest.raises(RuntimeError, match="simulated"):
        fit(tmp_path / "failed", True, None)
    resumed = fit(tmp_path / "failed", False, "last")
    assert sorted(resumed.by_step) == [3, 4]
    assert [resumed.by_step[3], resumed.by_step[4]] == [straight.by_step[3], straight.by_step[4]]
    assert resumed.logged() == straight.logged(after_step=logged_after_step)
    return straight, resumed


# (trainer.accumulate_grad_batches, data.steps_per_generation, the failing call): one micro-step per
# optimizer step; the first micro-step of step 3's window; its second, whose window started in the
# same generation batch or (one micro-step per generation batch) in the one before.
WINDOWS = {"no accumulation": (1, None, 3), "window start": (2, None, 5), "mid window": (2, None, 6),
           "mid window, two generations": (2, 1, 6)}


@pytest.mark.parametrize("accumulate, steps_per_generation, fail_at",
                         [WINDOWS["no accumulation"], (2, None, 3), WINDOWS["mid window, two generations"]],
                         ids=["no accumulation", "window start", "mid window, two generations"])
def test_a_run_failing_in_a_generation_resumes_with_the_random_stream_of_before_it(
        tmp_path, accumulate, steps_per_generation, fail_at):
    """The failure happens while step 3 samples (the ``fail_at``-th generation batch): ``on_exception.ckpt``
    holds the RNG as it was before that generation (not what the failed sampling left), so the
    resume samples step 3 as a run that never failed does: the same rewards at every step. A
    failure inside an accumulation window resumes at its start, replaying the generation batches it
    already drew from the checkpoint."""

    def fit(root, fail, ckpt_path):
        record = StepRecord()
        fit_four_steps(root, tmp_path, record, reward=FailOnce(fail_at if fail else None), ckpt_path=ckpt_path,
                       accumulate=accumulate, steps_per_generation=steps_per_generation)
        return record

    straight_and_resumed(fit, tmp_path)


@pytest.mark.parametrize("accumulate, steps_per_generation, fail_at, attention_dropout",
                         [(*window, 0.0) for window in WINDOWS.values()] + [(*WINDOWS["mid window, two generations"], 0.5)],
                         ids=[*WINDOWS, "mid window, two generations, dropout"])
def test_a_run_failing_inside_a_training_step_resumes_with_that_step(tmp_path, accumulate, steps_per_generation,
                                                                     fail_at, attention_dropout):
    """The failure happens in a micro-step of step 3 (the ``fail_at``-th training step), after its
    micro-batch was generated: ``on_exception.ckpt`` does not count that micro-step as trained, and
    one inside an accumulation window resumes at the window's start (the gradients gathered before
    the failure are not in a checkpoint), so the resumed run trains step 3 on the same micro-batches
    as a run that never failed: the same rewards and losses at every step. With dropout, training
    draws random numbers: each replayed micro-step draws what it drew before the failure."""

    class FailingStep(GRPOModule):
        fail_at: int | None = None

        def training_step(self, batch, batch_idx):
            type(self).calls = getattr(type(self), "calls", 0) + 1
            if type(self).calls == self.fail_at:
                raise RuntimeError("device error (simulated)")
            return super().training_step(batch, batch_idx)

    def fit(root, fail, ckpt_path):
        record = StepRecord()
        module_class = type("Module", (FailingStep,), {"fail_at": fail_at if fail else None, "calls": 0})
        fit_four_steps(root, tmp_path, record, module_class=module_class, ckpt_path=ckpt_path, accumulate=accumulate,
                       steps_per_generation=steps_per_generation, attention_dropout=attention_dropout)
        return record

    straight_and_resumed(fit, tmp_path)  # the averages since the last log included


class FailingValidation(GRPOModule):
    """Fails in the ``fail_batch``-th batch of the validation at step 2 (when ``fail``)."""

    fail, fail_batch = False, 0

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if type(self).fail and self.trainer.global_step == 2 and batch_idx == self.fail_batch:
            raise RuntimeError("evaluation failed (simulated)")
        return super().validation_step(batch, batch_idx, dataloader_idx)


@pytest.mark.parametrize("failure", ["its generation", "its second batch"])
def test_a_run_failing_in_a_validation_at_a_step_end_validates_again_from_its_start(tmp_path, failure):
    """Validation after every second step fails at step 2: while its first batch is generated (the
    reward), or in its second batch. The resumed run runs that whole validation again (Lightning
    alone would skip the first and run only the first batches of the second) and then trains and
    logs what a run that never failed does."""

    def fit(root, fail, ckpt_path):
        record = StepRecord()
        module_class = type("Module", (FailingValidation,), {"fail": fail and failure == "its second batch",
                                                             "fail_batch": 1})
        reward = FailOnce(3 if fail and failure == "its generation" else None)  # calls 1, 2: training; 3: evaluation
        fit_four_steps(root, tmp_path, record, module_class=module_class, reward=reward, ckpt_path=ckpt_path,
                       val_check_interval=2)
        return record

    straight_and_resumed(fit, tmp_path, logged_after_step=1)  # the evaluation at step 2 included


def test_a_run_failing_in_a_validation_inside_an_accumulation_window_resumes_exactly(tmp_path):
    """Validation every 5 micro-steps falls inside step 3's window (micro-steps 4 and 5); it fails
    there. The resumed run trains that window again, validates at the same point, and trains and
    logs what a run that never failed does."""

    def fit(root, fail, ckpt_path):
        record = StepRecord()
        module_class = type("Module", (FailingValidation,), {"fail": fail})
        fit_four_steps(root, tmp_path, record, module_class=module_class, ckpt_path=ckpt_path, accumulate=2,
                       val_check_interval=5)
        return record

    _, resumed = straight_and_resumed(fit, tmp_path, logged_after_step=1)  # the evaluation at step 2, steps 3, 4
    assert any(key.startswith("eval_") for step, row in resumed.logger.rows if step == 2 for key in row)


def test_a_failure_inside_the_optimizer_update_writes_no_checkpoint(tmp_path, caplog):
    """An optimizer that fails after its closure ran (an out-of-memory error in AdamW's update, after
    it moved its step counts and moments) leaves a half-applied update: no ``on_exception.ckpt``
    may hold it, and the warning says to resume from the last periodic checkpoint."""

    class FailingSGD(torch.optim.SGD):
        steps = 0

        def step(self, closure=None):
            loss = closure()
            type(self).steps += 1
            if type(self).steps == 3:
                raise RuntimeError("out of memory in the update (simulated)")
            with torch.no_grad():
                return super().step(lambda: loss)

    class Module(GRPOModule):
        def configure_optimizers(self):
            return FailingSGD(self.policy.parameters(), lr=1e-2)

    with pytest.raises(RuntimeError, match="simulated"):
        fit_four_steps(tmp_path / "run", tmp_path, StepRecord(), module_class=Module)
    assert not (tmp_path / "run" / "checkpoints" / "on_exception.ckpt").exists()
    assert "inside an optimizer update" in caplog.text


def test_a_resume_from_a_step_that_validated_keeps_what_the_validation_changed(tmp_path):
    """Checkpoints and validations every 2 steps: the step-2 checkpoint is written again after the
    step-2 validation, so a run resumed from it holds what that validation changed (here a count
    of validations a callback keeps, as ``EarlyStopping`` keeps its patience) and ends with the
    state of a run that never stopped."""

    class Validations(pl.Callback):
        def __init__(self):
            self.count = 0

        def on_validation_end(self, trainer, pl_module):
            self.count += 0 if trainer.sanity_checking else 1

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state_dict):
            self.count = state_dict["count"]

    class StopsAtThree(GRPOModule):
        stop = False

        def training_step(self, batch, batch_idx):
            if type(self).stop and self.trainer.global_step == 2:
                raise RuntimeError("preempted (simulated)")
            return super().training_step(batch, batch_idx)

    def fit(root, stop=False, ckpt_path=None):
        validations = Validations()
        fit_four_steps(root, tmp_path, StepRecord(), module_class=type("Module", (StopsAtThree,), {"stop": stop}),
                       ckpt_path=ckpt_path, val_check_interval=2, every_n_steps=2, callbacks=[validations])
        return validations.count

    assert fit(tmp_path / "straight") == 2
    with pytest.raises(RuntimeError, match="simulated"):
        fit(tmp_path / "stopped", stop=True)
    step2 = checkpoint_dir(str(tmp_path / "stopped")) + "/step=0000002.ckpt"
    states = torch.load(step2, weights_only=False)["callbacks"]
    assert [state for key, state in states.items() if key.endswith("Validations")] == [{"count": 1}]
    assert fit(tmp_path / "stopped", ckpt_path=step2) == 2

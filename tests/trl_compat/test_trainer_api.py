"""``GRPOTrainer``'s transformers API without a run: ``push_to_hub(private=...)``, ``state``, the
callback list (``add_callback``, ``pop_callback``, ``remove_callback``), ``log``,
``is_world_process_zero``, ``create_model_card``; and ``FlushStepLogs``' two log schedules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo_lightning import GRPOConfig, GRPOTrainer
from grpo_lightning.errors import ConfigError
from grpo_lightning.module.metrics import TrainingMetrics
from grpo_lightning.module.step_logging import FlushStepLogs
from tests.trl_compat.rewards import StopAfterFirstStep, length_reward


class LogRecorder:
    """A duck-typed HF callback keeping the ``logs`` of each ``on_log``."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))


@pytest.fixture()
def hub_calls(monkeypatch):
    import huggingface_hub

    calls: dict = {}
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.update(create=kw) or
                        huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}"))
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: calls.update(upload=kw) or "commit")
    return calls


@pytest.mark.parametrize(("hub_private_repo", "private", "expected"),
                         [(None, True, True), (True, False, False), (True, None, True), (None, None, None)])
def test_push_to_hub_private_wins_over_hub_private_repo(tiny_model, prompts, tmp_path, hub_calls, hub_private_repo,
                                                       private, expected):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = GRPOConfig(output_dir=str(tmp_path / "out"), hub_model_id="me/secret", bf16=False,
                      hub_private_repo=hub_private_repo)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model), reward_funcs=length_reward,
                          processing_class=AutoTokenizer.from_pretrained(tiny_model), args=args, train_dataset=prompts)
    assert trainer.push_to_hub(private=private) == "commit"
    assert hub_calls["create"]["private"] is expected


def test_state_callbacks_and_log_before_a_run(tiny_model, prompts, tmp_path, monkeypatch):
    from transformers import TrainerState

    recorder = LogRecorder()
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=prompts,
                          args=GRPOConfig(output_dir=str(tmp_path)), callbacks=[recorder])
    assert isinstance(trainer.state, TrainerState) and trainer.state.log_history is trainer.log_history

    trainer.add_callback(StopAfterFirstStep)  # a class: built here
    added = trainer.callback_handler.callbacks[-1]
    assert isinstance(added, StopAfterFirstStep)
    assert trainer.pop_callback(StopAfterFirstStep) is added
    assert trainer.pop_callback(StopAfterFirstStep) is None  # not there: None, as HF
    instance = StopAfterFirstStep()
    trainer.add_callback(instance)
    trainer.remove_callback(instance)
    assert trainer.callback_handler.callbacks == [recorder]
    trainer.add_callback(LogRecorder)
    trainer.remove_callback(LogRecorder)  # by class: the first of that class (the recorder given first)
    assert [type(c) for c in trainer.callback_handler.callbacks] == [LogRecorder]
    assert trainer.callback_handler.callbacks[0] is not recorder

    class OnPredict:
        def on_predict(self, args, state, control, **kw):
            pass

    with pytest.raises(ConfigError, match="on_predict"):
        trainer.add_callback(OnPredict)

    # Lightning callbacks go into the same list operations (the constructor takes both kinds)
    from lightning.pytorch.callbacks import LearningRateMonitor

    trainer.add_callback(LearningRateMonitor)
    assert isinstance(trainer.pop_callback(LearningRateMonitor), LearningRateMonitor)
    monitor = LearningRateMonitor()
    trainer.add_callback(monitor)
    trainer.remove_callback(monitor)
    assert trainer.pop_callback(LearningRateMonitor) is None
    with pytest.raises(ValueError, match="not among the trainer's callbacks"):
        trainer.remove_callback(monitor)

    kept = trainer.callback_handler.callbacks[0]
    trainer.log({"my_metric": 1.5})
    assert trainer.log_history[-1] == {"my_metric": 1.5, "epoch": 0, "step": 0}  # TrainerState's epoch: 0 at first
    assert kept.logs == [{"my_metric": 1.5, "epoch": 0}]

    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    monkeypatch.setenv("RANK", "1")
    assert not trainer.is_world_process_zero()


def test_added_callback_classes_go_into_the_yaml_file(tiny_model, prompts, tmp_path):
    import yaml

    trainer = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=prompts,
                          args=GRPOConfig(output_dir=str(tmp_path)))
    trainer.add_callback(StopAfterFirstStep)
    entry = yaml.safe_load(trainer.to_yaml())["trainer"]["callbacks"][-1]
    assert entry["init_args"]["callbacks"] == ["tests.trl_compat.rewards.StopAfterFirstStep"]
    trainer.remove_callback(StopAfterFirstStep)
    entries = yaml.safe_load(trainer.to_yaml())["trainer"]["callbacks"]
    assert all("TrainerCallbacks" not in c["class_path"] for c in entries)


def test_create_model_card_writes_the_readme_to_output_dir(tiny_model, prompts, tmp_path):
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=prompts,
                          args=GRPOConfig(output_dir=str(tmp_path / "out")))
    trainer.create_model_card(model_name="tiny-grpo", dataset_name="tiny/prompts", tags="math")
    text = (tmp_path / "out" / "README.md").read_text()
    assert "# tiny-grpo" in text and "tiny/prompts" in text and "- math" in text


class _Recorder:
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))


def _run_steps(flush: FlushStepLogs, rewards: list[float], steps_per_epoch: int, stop_at: int | None = None):
    """Drive ``flush`` through one optimizer step per reward (a fake trainer, ``log_every_n_steps=3``)."""
    logger = _Recorder()
    progress = SimpleNamespace(is_last_batch=False)
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=3, should_stop=False, loggers=[logger],
                              current_epoch=0, num_training_batches=steps_per_epoch,
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    flush.on_train_start(trainer, None)
    for i, reward in enumerate(rewards):
        flush.metrics.add({"reward": reward})
        trainer.global_step += 1
        trainer.should_stop = trainer.global_step == stop_at
        progress.is_last_batch = (i + 1) % steps_per_epoch == 0
        flush.on_train_batch_end(trainer, None, None, None, i % steps_per_epoch)
        if (i + 1) % steps_per_epoch == 0:
            flush.on_train_epoch_end(trainer, None)
            trainer.current_epoch += 1
        if trainer.should_stop:
            break
    return [(step, metrics["reward"]) for step, metrics in logger.logged]


def test_flush_step_logs_at_multiples_only_carries_the_window_over_an_epoch_end():
    rewards = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    # grpo fit (the default): also at each epoch's end (2 steps) and when training stops
    assert _run_steps(FlushStepLogs(TrainingMetrics()), rewards, steps_per_epoch=2, stop_at=7) == [
        (2, 1.5), (3, 3.0), (4, 4.0), (6, 5.5), (7, 7.0)]
    # GRPOTrainer (TRL): at multiples of 3 only; the window runs over epoch ends; the rest stays unlogged
    flush = FlushStepLogs(TrainingMetrics(), flush_at_boundaries=False)
    assert _run_steps(flush, rewards, steps_per_epoch=2, stop_at=7) == [(3, 2.0), (6, 5.0)]
    assert flush.metrics.flush_log() == {"reward": 7.0}  # step 7: for the end-of-training summary
    # logging_first_step=True: step 1 is logged too, then the window starts afresh
    first = FlushStepLogs(TrainingMetrics(), flush_at_boundaries=False, log_first_step=True)
    assert _run_steps(first, rewards, steps_per_epoch=2, stop_at=7) == [(1, 1.0), (3, 2.5), (6, 5.0)]


def test_logging_first_step_reaches_the_flow_callback(tmp_path):
    import yaml

    from grpo_lightning import config_to_yaml

    config = yaml.safe_load(config_to_yaml(GRPOConfig(output_dir=str(tmp_path), logging_first_step=True),
                                           model="m", train_dataset="d.jsonl", reward_funcs=["m.r"]))
    (flow,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("TRLStepFlow")]
    assert flow["init_args"] == {"evaluate_at_end": False, "log_first_step": True}

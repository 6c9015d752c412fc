"""``GRPOTrainer`` runs: log_history, HF callbacks at their Lightning hooks, evaluate, save_model,
push_to_hub at the huggingface_hub boundary (offline), a caller's optimizer object."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning import GRPOConfig, GRPOTrainer
from grpo_lightning.errors import ConfigError
from tests.trl_compat.rewards import StopAfterFirstStep, length_reward

SCORED: list[tuple[str, float]] = []  # (completion, reward) of every call of recording_reward


def recording_reward(completions, **kwargs):
    rewards = [float(len(c)) for c in completions]
    SCORED.extend(zip(completions, rewards))
    return rewards


class EventLog:
    """A duck-typed HF callback (no TrainerCallback base) recording the events it sees."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.logs: list[dict] = []
        self.eval_metrics: list[dict] = []
        self.gradients_at_optimizer_step: list[bool] = []

    def _note(self, name, state):
        self.events.append((name, state.global_step))

    def on_init_end(self, args, state, control, **kw): self._note("on_init_end", state)  # noqa: E704
    def on_train_begin(self, args, state, control, **kw): self._note("on_train_begin", state)  # noqa: E704
    def on_epoch_begin(self, args, state, control, **kw): self._note("on_epoch_begin", state)  # noqa: E704
    def on_step_begin(self, args, state, control, **kw): self._note("on_step_begin", state)  # noqa: E704
    def on_substep_end(self, args, state, control, **kw): self._note("on_substep_end", state)  # noqa: E704
    def on_step_end(self, args, state, control, **kw): self._note("on_step_end", state)  # noqa: E704

    def on_optimizer_step(self, args, state, control, model=None, **kw):  # HF: "useful for monitoring gradients"
        self._note("on_optimizer_step", state)
        self.gradients_at_optimizer_step.append(all(p.grad is not None for p in model.parameters() if p.requires_grad))
    def on_save(self, args, state, control, **kw): self._note("on_save", state)  # noqa: E704
    def on_train_end(self, args, state, control, **kw): self._note("on_train_end", state)  # noqa: E704
    def on_push_begin(self, args, state, control, **kw): self._note("on_push_begin", state)  # noqa: E704

    def on_log(self, args, state, control, logs=None, model=None, **kw):
        assert isinstance(model, torch.nn.Module)
        self._note("on_log", state)
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self._note("on_evaluate", state)
        self.eval_metrics.append(dict(metrics))


@pytest.mark.slow
def test_train_evaluate_save_and_push(tiny_model, prompts, tmp_path, monkeypatch):
    import huggingface_hub
    from transformers import AutoModelForCausalLM

    events = EventLog()
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, logging_steps=1, learning_rate=1e-2,
                      num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      max_completion_length=6, save_steps=1, per_device_eval_batch_size=8, bf16=False,
                      hub_model_id="me/tiny-grpo", hub_private_repo=True, hub_token="tok")
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=recording_reward, args=args, train_dataset=prompts,
                          eval_dataset=prompts.select(range(4)), callbacks=[events])

    SCORED.clear()
    before = trainer.evaluate()  # grpo validate with the untrained policy
    assert before["eval_reward"] == pytest.approx(sum(r for _, r in SCORED) / len(SCORED))
    assert len(SCORED) == 4 * 4  # 4 prompts x num_generations

    output = trainer.train()
    steps = [e for e in trainer.log_history if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    assert output.global_step == 2
    assert output.training_loss == pytest.approx(sum(e["loss"] for e in steps) / 2)
    assert trainer.log_history[-1]["train_loss"] == pytest.approx(output.training_loss)
    assert events.logs[-3:-1] == [{k: v for k, v in e.items() if k != "step"} for e in steps]
    assert events.logs[-1]["train_loss"] == pytest.approx(output.training_loss)  # the summary: on_log too, as HF

    names = [name for name, _ in events.events]
    assert names[0] == "on_init_end" and names.count("on_init_end") == 1  # once, at the first setup (evaluate)
    assert names.index("on_evaluate") < names.index("on_train_begin") < names.index("on_epoch_begin") < \
        names.index("on_step_begin")
    train_events = [(n, s) for n, s in events.events
                    if n in ("on_step_begin", "on_substep_end", "on_optimizer_step", "on_step_end")]
    # gradient_accumulation_steps=2: each optimizer step is begin, one sub-step, the optimizer step (global_step
    # before it counts, as HF), end (global_step after the step)
    assert train_events == [("on_step_begin", 0), ("on_substep_end", 0), ("on_optimizer_step", 0), ("on_step_end", 1),
                            ("on_step_begin", 1), ("on_substep_end", 1), ("on_optimizer_step", 1), ("on_step_end", 2)]
    assert events.gradients_at_optimizer_step == [True, True]  # the gradients the step applied
    assert ("on_save", 1) in events.events and ("on_save", 2) in events.events  # save_steps=1
    assert names[-1] == "on_train_end"

    SCORED.clear()
    after = trainer.evaluate()  # the trained policy, in the same Lightning trainer
    assert after["eval_reward"] == pytest.approx(sum(r for _, r in SCORED) / len(SCORED))
    assert events.eval_metrics[-1]["eval_reward"] == after["eval_reward"]

    trainer.save_model(str(tmp_path / "saved"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(saved.state_dict()[name], value), name

    calls = {}
    monkeypatch.setattr(huggingface_hub, "create_repo",
                        lambda repo_id, **kw: calls.update(create=(repo_id, kw)) or huggingface_hub.RepoUrl(
                            f"https://huggingface.co/{repo_id}"))
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: calls.update(upload=kw) or "commit")
    assert trainer.push_to_hub(commit_message="done", dataset_name="tiny/prompts") == "commit"
    assert calls["create"] == ("me/tiny-grpo", {"token": "tok", "private": True, "exist_ok": True})
    upload = calls["upload"]
    assert (upload["repo_id"], upload["commit_message"], upload["token"], upload["run_as_future"]) == (
        "me/tiny-grpo", "done", "tok", False)
    folder = upload["folder_path"]
    assert (tmp_path / "out" / "final_model" / "config.json").exists() and folder == str(tmp_path / "out" / "final_model")
    assert "tiny/prompts" in (tmp_path / "out" / "final_model" / "README.md").read_text()
    assert names.count("on_push_begin") == 0 and events.events[-1][0] == "on_push_begin"


class CountBatches(pl.Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, *args, **kwargs):
        self.batches += 1


@pytest.mark.slow
def test_stop_flag_and_a_callers_optimizer(tiny_model, prompts, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=3, logging_steps=1, num_generations=4,
                      max_completion_length=4, save_strategy="no", bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=prompts,
                          processing_class=_tokenizer(tiny_model), optimizers=(optimizer, None),
                          callbacks=[StopAfterFirstStep])
    trainer.add_callback(CountBatches)  # a Lightning callback class, added as an HF one would be
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert trainer.lightning_trainer.global_step == 1  # control.should_training_stop after step 1
    (counter,) = [c for c in trainer.lightning_trainer.callbacks if isinstance(c, CountBatches)]
    assert counter.batches == 1
    assert trainer.lightning_trainer.optimizers[0] is optimizer
    assert trainer.model is model  # trained in place
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with pytest.raises(ConfigError, match="optimizer object"):
        trainer.to_yaml()


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_an_unsupported_callback_event_is_refused_before_anything_runs(tiny_model, prompts, tmp_path):
    from transformers import TrainerCallback

    class OnPreOptimizerStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            pass

    with pytest.raises(ConfigError, match=r"on_pre_optimizer_step.*Supported events: on_init_end"):
        GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=prompts,
                    args=GRPOConfig(output_dir=str(tmp_path)), callbacks=[OnPreOptimizerStep()])


def test_a_scheduler_object_is_refused_with_the_setting_to_use(tiny_model, prompts, tmp_path):
    with pytest.raises(ConfigError, match="lr_scheduler_type"):
        GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=prompts,
                    args=GRPOConfig(output_dir=str(tmp_path)), optimizers=(None, object()))


def test_trl_config_object_is_refused(tiny_model, prompts):
    class GRPOConfigFromTRL:
        pass

    with pytest.raises(ConfigError, match="from grpo_lightning import GRPOConfig"):
        GRPOTrainer(model=tiny_model, reward_funcs=length_reward, train_dataset=prompts, args=GRPOConfigFromTRL())

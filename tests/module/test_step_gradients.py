"""An applied optimizer step's gradients are dropped at the end of its batch (as TRL's HF Trainer
does right after ``optimizer.step()``), not inside the next step's closure: the next generation
and training forward run without them. Callbacks still see them, inside an accumulation window
they are kept, and the training itself does not change by a bit."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.step_gradients import StepGradients
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


def _holds_gradients(module: GRPOModule) -> bool:
    return any(p.grad is not None for p in module.policy.parameters())


class GradientsSeen(pl.Callback):
    """Whether the policy holds gradients at each batch's start (after its generation) and end."""

    def __init__(self) -> None:
        self.at_start: list[bool] = []
        self.at_end: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.at_start.append(_holds_gradients(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.at_end.append(_holds_gradients(pl_module))


def _fit(tmp_path, *, steps: int = 3, accumulate: int = 1, rows: int = 8):
    tmp_path.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(7, verbose=False)
    seen = GradientsSeen()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accumulate_grad_batches=accumulate,
                         default_root_dir=tmp_path / "run", callbacks=[seen])
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=rows, generation=GenerationParams(max_completion_length=4))
    module = GRPOModule(make_model_dir(tmp_path / "m"), learning_rate=1e-2, save_final_model=False)
    at_generation: list[bool] = []
    generate = data.sampler.generate

    def spy(*args, **kwargs):
        at_generation.append(module._trainer is not None and _holds_gradients(module))
        return generate(*args, **kwargs)

    data.sampler.generate = spy
    trainer.fit(module, data)
    return module, seen, at_generation


def test_generation_and_the_next_forward_run_without_the_last_steps_gradients(tmp_path):
    module, seen, at_generation = _fit(tmp_path)
    assert len(at_generation) == 3 and not any(at_generation)
    assert seen.at_start == [False, False, False]  # Lightning's zero_grad would only come before the backward
    assert seen.at_end == [True, True, True]  # a callback still reads the gradients the step applied


def test_inside_an_accumulation_window_the_gradients_are_kept(tmp_path):
    _, seen, at_generation = _fit(tmp_path, steps=2, accumulate=2, rows=4)
    assert seen.at_start == [False, True, False, True]  # micro-steps 1 and 3 add to their window's gradients
    assert seen.at_end == [True, True, True, True]
    assert not any(at_generation)  # a generation batch spans one window: generated at its start


def test_dropping_them_early_changes_no_weight(tmp_path, monkeypatch):
    early, _, _ = _fit(tmp_path / "early")
    monkeypatch.setattr(StepGradients, "release", lambda self, optimizers: None)  # Lightning's timing alone
    late, seen, _ = _fit(tmp_path / "late")
    assert seen.at_start == [False, True, True]  # without the release the gradients live into the next step
    early_state, late_state = early.policy.state_dict(), late.policy.state_dict()
    assert early_state.keys() == late_state.keys()
    assert all(torch.equal(early_state[k], late_state[k]) for k in early_state)


def test_release_happens_once_per_applied_step():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    gradients = StepGradients()
    weight.sum().backward()
    gradients.release([optimizer])
    assert weight.grad is not None  # no step applied yet: an accumulation window keeps its gradients
    optimizer.step()
    gradients.step_applied()
    gradients.release([optimizer])
    assert weight.grad is None
    weight.sum().backward()
    gradients.release([optimizer])
    assert weight.grad is not None  # released once; the next window's gradients are its own

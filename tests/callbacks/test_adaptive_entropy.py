"""``AdaptiveEntropy``: TRL's adaptive entropy controller (spec §3.11) as a callback."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.callbacks import AdaptiveEntropy
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.entropy_selection import EntropyWindow
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


def fake_run(initial_coef: float):
    module = SimpleNamespace(entropy_coef=initial_coef, entropy_window=None, entropy_coef_metric=None)
    trainer = SimpleNamespace(world_size=1)
    return trainer, module


def feed_window(window: EntropyWindow, entropy: float) -> None:
    """Two micro-steps of 3 and 1 tokens whose token mean is ``entropy`` (their own means differ)."""
    window.add(torch.tensor([[1.0, 2.0, 3.0, 9.0]]), torch.tensor([[1, 1, 1, 0]]))
    window.add(torch.tensor([[4 * entropy - 6.0, 5.0]]), torch.tensor([[1, 0]]))


def test_trajectory_over_five_steps_against_hand_computed_values():
    callback = AdaptiveEntropy(entropy_target=2.0, entropy_coef_delta=0.01, entropy_coef_min=0.004,
                               entropy_coef_max=0.025)
    trainer, module = fake_run(initial_coef=0.01)
    callback.setup(trainer, module, "fit")
    callback.on_train_start(trainer, module)
    # Before any step: the initial coefficient is logged, but no entropy was measured, so no bonus.
    assert (callback.entropy_coef, module.entropy_coef, module.entropy_coef_metric) == (0.01, 0.0, 0.01)
    entropies = [2.5, 1.5, 1.8, 1.9, 3.0]
    # By hand: c0 = 0.01, δ = 0.01, bounds [0.004, 0.025], target 2.0.
    # step 1: H = 2.5 > 2 -> c = max(0.01 - 0.01, 0.004) = 0.004 (clamped); next step applies 0 (H above target)
    # step 2: H = 1.5 <= 2 -> c = 0.004 + 0.01 = 0.014; applies 0.014
    # step 3: H = 1.8 -> c = 0.024; applies 0.024
    # step 4: H = 1.9 -> c = min(0.034, 0.025) = 0.025 (clamped); applies 0.025
    # step 5: H = 3.0 -> c = 0.015; applies 0
    expected_coef = [0.004, 0.014, 0.024, 0.025, 0.015]
    expected_applied = [0.0, 0.014, 0.024, 0.025, 0.0]
    for step, entropy in enumerate(entropies):
        feed_window(module.entropy_window, entropy)
        callback.on_before_optimizer_step(trainer, module, optimizer=None)
        assert callback.last_world_entropy == pytest.approx(entropy, abs=1e-6)
        assert callback.entropy_coef == pytest.approx(expected_coef[step], abs=1e-12)
        assert module.entropy_coef_metric == pytest.approx(expected_coef[step], abs=1e-12)  # logged: after the update
        assert module.entropy_coef == pytest.approx(expected_applied[step], abs=1e-12)  # the next step's bonus
        assert module.entropy_window.take() == (0.0, 0.0)  # the window restarts each step


def test_a_step_without_tokens_leaves_the_controller_unchanged():
    callback = AdaptiveEntropy(entropy_target=5.0)
    trainer, module = fake_run(initial_coef=0.02)
    callback.setup(trainer, module, "fit")
    callback.on_train_start(trainer, module)
    feed_window(module.entropy_window, 1.0)
    callback.on_before_optimizer_step(trainer, module, None)
    state = callback.state_dict()
    module.entropy_window.add(torch.ones(1, 3), torch.zeros(1, 3))  # every token masked
    callback.on_before_optimizer_step(trainer, module, None)
    assert callback.state_dict() == state == {"entropy_coef": pytest.approx(0.025), "last_world_entropy": 1.0}
    assert module.entropy_coef == pytest.approx(0.025)


def test_under_an_accumulating_engine_only_the_window_boundary_updates():
    """DeepSpeed calls on_before_optimizer_step on every micro-step; its engine marks the last one."""
    callback = AdaptiveEntropy(entropy_target=5.0)
    _, module = fake_run(initial_coef=0.01)
    engine = SimpleNamespace(micro_steps=0, is_gradient_accumulation_boundary=lambda: engine.micro_steps % 2 == 1)
    trainer = SimpleNamespace(world_size=1, strategy=SimpleNamespace(handles_gradient_accumulation=True, model=engine))
    callback.setup(trainer, module, "fit")
    callback.on_train_start(trainer, module)
    for micro_step in range(4):  # two optimizer steps of two micro-steps
        engine.micro_steps = micro_step
        module.entropy_window.add(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2))
        callback.on_before_optimizer_step(trainer, module, None)
    assert callback.entropy_coef == pytest.approx(0.02)  # two updates, not four
    assert callback.last_world_entropy == 2.0


def test_state_round_trip_and_bad_arguments():
    callback = AdaptiveEntropy()
    callback.load_state_dict({"entropy_coef": 0.3, "last_world_entropy": 0.1})
    trainer, module = fake_run(initial_coef=0.0)
    callback.on_train_start(trainer, module)  # restored: the module's initial value is not used
    assert (module.entropy_coef, module.entropy_coef_metric) == (0.3, 0.3)
    assert AdaptiveEntropy().state_dict() == {"entropy_coef": None, "last_world_entropy": math.inf}
    with pytest.raises(ValueError, match="entropy_coef_min=0.5 > entropy_coef_max=0.1"):
        AdaptiveEntropy(entropy_coef_min=0.5, entropy_coef_max=0.1)
    with pytest.raises(ValueError, match="entropy_coef_delta=-1"):
        AdaptiveEntropy(entropy_coef_delta=-1)
    with pytest.raises(ValueError, match="entropy_target=nan"):
        AdaptiveEntropy(entropy_target=float("nan"))
    with pytest.raises(TypeError, match="GRPOModule.entropy_coef"):
        AdaptiveEntropy().setup(SimpleNamespace(), SimpleNamespace(), "fit")


class RecordCoefficients(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches != trainer.accumulate_grad_batches - 1:
            return
        controller = next(c for c in trainer.callbacks if isinstance(c, AdaptiveEntropy))
        self.steps.append({**pl_module.step_metrics, "applied": pl_module.entropy_coef,
                           "measured": controller.last_world_entropy})


def fit(tmp_path, root, max_steps, *, accumulate=1, ckpt_path=None, target=100.0):
    pl.seed_everything(0, verbose=False)  # the same sampled completions in every run (a resume restores the RNG)
    recorder = RecordCoefficients()
    callbacks = [AdaptiveEntropy(entropy_target=target), recorder,
                 ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)]
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root), callbacks=callbacks,
                         accumulate_grad_batches=accumulate)
    # a constant learning rate: the 3-step run must train like the first 3 steps of the 5-step one
    module = GRPOModule(str(tmp_path / "model"), entropy_coef=0.01, learning_rate=1e-2, lr_scheduler_type="constant",
                        save_final_model=False)
    data = RolloutDataModule(str(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=4, generation=GenerationParams(max_completion_length=4))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return recorder.steps


@pytest.fixture
def run_inputs(tmp_path):
    make_model_dir(tmp_path / "model")
    write_prompts(tmp_path / "p.jsonl", num_rows=16)
    return tmp_path


@pytest.mark.slow
def test_in_training_the_coefficient_rises_by_delta_per_optimizer_step(run_inputs):
    """TRL's test_train_with_adaptive_entropy_gradient_accumulation: a target above the entropy,
    GA=2: the logged coefficient is 0.01 + 0.005·step exactly; the measured entropy is the
    step's token mean, and the bonus applies from the second step on."""
    steps = fit(run_inputs, run_inputs / "run", max_steps=2, accumulate=2)
    assert [s["entropy_coef"] for s in steps] == pytest.approx([0.015, 0.02], abs=1e-12)
    assert [s["applied"] for s in steps] == pytest.approx([0.015, 0.02], abs=1e-12)
    assert "policy_loss" not in steps[0] and "policy_loss" in steps[1]  # step 1 ran with coefficient 0
    assert all(0 < s["measured"] < 100 for s in steps)


@pytest.mark.slow
def test_resume_after_step_three_continues_the_coefficient(run_inputs):
    straight = fit(run_inputs, run_inputs / "a", max_steps=5, target=1e9)
    first = fit(run_inputs, run_inputs / "b", max_steps=3, target=1e9)
    resumed = fit(run_inputs, run_inputs / "b", max_steps=5, target=1e9,
                  ckpt_path=str(run_inputs / "b/ckpt/epoch=0-step=3.ckpt"))
    assert [s["entropy_coef"] for s in straight] == pytest.approx([0.015, 0.02, 0.025, 0.03, 0.035], abs=1e-12)
    assert len(resumed) == 2
    for got, want in zip(first + resumed, straight):
        assert got["entropy_coef"] == pytest.approx(want["entropy_coef"], abs=1e-12)
        assert got["applied"] == pytest.approx(want["applied"], abs=1e-12)
        assert got["measured"] == pytest.approx(want["measured"], rel=1e-5)  # the same run, continued
        # one micro-step per optimizer step: the controller's entropy is the logged one
        assert got["measured"] == pytest.approx(got["entropy"], rel=1e-6)
    assert "policy_loss" in resumed[0]  # the restored last entropy keeps the bonus on at once


def test_the_settings_parse_from_yaml(run_inputs, capsys):
    """The seed's adaptive-entropy example as a ``grpo fit`` config: every key has a home."""
    import yaml

    from grpo_lightning.cli import main

    config = {
        "trainer": {"max_steps": 1, "accelerator": "cpu", "callbacks": [
            {"class_path": "grpo_lightning.callbacks.AdaptiveEntropy",
             "init_args": {"entropy_target": 5.0, "entropy_coef_delta": 0.005, "entropy_coef_min": 0.0,
                           "entropy_coef_max": 1.0}}]},
        "model": {"model": str(run_inputs / "model"), "entropy_coef": 0.01, "top_entropy_quantile": 0.2,
                  "cast_lm_head_to_fp32": True, "router_aux_loss_coef": None},
        "data": {"dataset": str(run_inputs / "p.jsonl"), "reward_funcs": ["tests.helpers.length_reward"]},
    }
    path = run_inputs / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    model = printed["model"]
    assert (model["entropy_coef"], model["top_entropy_quantile"], model["cast_lm_head_to_fp32"]) == (0.01, 0.2, True)
    assert model["router_aux_loss_coef"] is None
    (callback,) = [c for c in printed["trainer"]["callbacks"] if c["class_path"].endswith("AdaptiveEntropy")]
    assert callback["init_args"] == {"entropy_target": 5.0, "entropy_coef_delta": 0.005, "entropy_coef_min": 0.0,
                                     "entropy_coef_max": 1.0}

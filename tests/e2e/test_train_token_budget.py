"""``forward.train_token_budget``: a micro-batch trained in token-sized parts (one forward+backward
each) takes the same optimizer step and logs the same metrics as the one-pass micro-batch, to
float32 rounding (``tests/e2e/same_step.py``)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.losses import DAPOLoss, get_loss
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.types import GenerationParams
from tests.e2e.same_step import assert_same_sgd_step, logit_bound
from tests.module.test_forward_paths import reduction_size
from tests.numerics import assert_close_f32
from tests.helpers import MemoryLogger, built, free_port, length_reward, make_model_dir, write_prompts

REPO = Path(__file__).resolve().parents[2]


def one_step(model_dir, prompts, loss, forward: ForwardOptions, tmp_path, entropy_coef=0.0):
    pl.seed_everything(11)
    module = GRPOModule(
        model_dir, loss=loss, optimizer=functools.partial(torch.optim.SGD, lr=1.0), lr_scheduler_type="constant",
        save_final_model=False, forward=forward, entropy_coef=entropy_coef,
    )
    calls = {"parts": 0}
    score = module._policy_loss

    def counting(batch, totals):
        calls["parts"] += 1
        return score(batch, totals)

    module._policy_loss = counting
    data = RolloutDataModule(prompts, reward_funcs=[length_reward], num_generations=4, per_device_train_batch_size=4,
                             steps_per_generation=2, generation=GenerationParams(max_completion_length=8))
    logger = MemoryLogger()
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=logger, enable_progress_bar=False, log_every_n_steps=1,
                         enable_model_summary=False, enable_checkpointing=False, accumulate_grad_batches=2,
                         default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    weights = [p.detach().clone() for p in module.policy.parameters()]
    return weights, logger.rows[0][1], calls["parts"], data


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss, entropy_coef",
    [("grpo", 0.0), ("bnpo", 0.01), ("dr_grpo", 0.0), (DAPOLoss(beta=0.1), 0.01), ("luspo", 0.0)],
    ids=["grpo", "bnpo+entropy", "dr_grpo", "dapo+kl+entropy", "luspo"],
)
@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_token_budget_parts_take_the_same_step(tmp_path, loss, entropy_coef, padding_free):
    model_dir = make_model_dir(tmp_path / "m")
    prompts = write_prompts(tmp_path / "p.jsonl")
    initial = [p.detach().clone() for p in built(GRPOModule(model_dir)).policy.parameters()]
    loss = get_loss(loss) if isinstance(loss, str) else loss
    one_pass, metrics, calls, data = one_step(
        model_dir, prompts, loss, ForwardOptions(padding_free=padding_free), tmp_path, entropy_coef
    )
    assert calls == 2  # two micro-steps, one pass each
    budget = ForwardOptions(padding_free=padding_free, train_token_budget=12)  # a row or two per part
    in_parts, part_metrics, part_calls, _ = one_step(model_dir, prompts, loss, budget, tmp_path, entropy_coef)
    assert part_calls > 4, "the budget must split the micro-batches, or the comparison is vacuous"
    moved = sum(float((w - i).abs().sum()) for w, i in zip(one_pass, initial))
    assert moved > 1e-3, "the step did not move the weights: the comparison would be vacuous"
    from transformers import AutoModelForCausalLM

    batches = data.buffer.batches
    width = max(b.prompt_ids.shape[1] + b.completion_ids.shape[1] for b in batches)
    tokens = sum(int(b.completion_mask.sum()) for b in batches)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    temperature = batches[0].temperature
    assert_same_sgd_step(in_parts, one_pass, initial, model, width=width, tokens=tokens, temperature=temperature)
    timing = {"step_time", "epoch"}
    assert metrics.keys() == part_metrics.keys()
    # A metric is a token mean, a count or a norm of the step's float32 values: relative to its own
    # magnitude, or for the loss to its token terms (|A| ≤ 1.5 for a group of 4 over its unbiased
    # std, plus the bonus), times the logits' magnitude as for the gradients.
    size = 2 * reduction_size(model, width) + tokens
    logit_scale = logit_bound(model, temperature) + 1.0
    for name in metrics.keys() - timing:
        scale = logit_scale * max(abs(metrics[name]), 2.0)
        assert_close_f32(part_metrics[name], metrics[name], reduction_size=size, scale=scale, sides=2, nan_ok=True,
                         msg=name)


def _ddp_final_weights(tmp_path: Path, name: str, forward: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    run_dir = tmp_path / name
    config = {
        "seed_everything": 5,
        "trainer": {"max_steps": 1, "accelerator": "cpu", "devices": 2, "strategy": "ddp",
                    "default_root_dir": str(run_dir), "logger": False, "enable_progress_bar": False,
                    "enable_checkpointing": False, "accumulate_grad_batches": 2},
        # SGD: Adam's first step is about lr·sign(g), which turns rounding noise of tiny gradients
        # into full-size differences.
        "model": {"model": make_model_dir(tmp_path / "model"), "loss": "grpo", "forward": forward,
                  "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 1.0}},
                  "lr_scheduler_type": "constant"},
        "data": {"dataset": write_prompts(tmp_path / "p.jsonl"), "reward_funcs": ["tests.helpers.length_reward"],
                 "num_generations": 4, "per_device_train_batch_size": 4, "generation": {"max_completion_length": 6}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(free_port())}
    result = subprocess.run(
        [sys.executable, "-m", "grpo_lightning.cli", "fit", "--config", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


@pytest.mark.slow
def test_token_budget_under_ddp_takes_the_same_step(tmp_path):
    """Parts backpropagated inside ``training_step`` accumulate locally; the micro-step's last
    backward syncs the sum across ranks, as with one pass."""
    from transformers import AutoModelForCausalLM

    one_pass = _ddp_final_weights(tmp_path, "one_pass", {})
    in_parts = _ddp_final_weights(tmp_path, "in_parts_run", {"train_token_budget": 16})
    initial = built(GRPOModule(make_model_dir(tmp_path / "model"))).policy.state_dict()
    assert any(not torch.equal(one_pass[k], initial[k]) for k in one_pass), "the step did not move the weights"
    keys = list(one_pass)
    # "a+b=" prompts (at most 8 tokens with special tokens) and 6 completion tokens; 2 ranks × 2
    # micro-batches × 4 rows × 6 tokens in the step
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert_same_sgd_step([in_parts[k] for k in keys], [one_pass[k] for k in keys], [initial[k] for k in keys], model,
                         width=8 + 6, tokens=2 * 2 * 4 * 6, names=keys)

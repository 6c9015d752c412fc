"""An epoch whose micro-steps are not a multiple of ``accumulate_grad_batches`` ends with a short
accumulation window; Lightning steps the optimizer there with fewer micro-batches. That step must
be the step of a window of its own size: its accumulation divisor and global token count cover
only the micro-batches it has (before the fix, its gradient was halved here)."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.losses import LossInputs
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.forward import completion_logprobs
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts


class CaptureLastWindow(pl.Callback):
    """Keeps the policy and batch before micro-step 2 and the gradients of the step it ends."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            self.policy, self.batch = copy.deepcopy(pl_module.policy), batch

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 1:
            self.grads = [p.grad.detach().clone() for p in pl_module.policy.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dapo", "grpo"])
def test_short_last_window_is_a_step_of_its_own_size(tmp_path, loss):
    pl.seed_everything(5)
    capture = CaptureLastWindow()
    module = GRPOModule(make_model_dir(tmp_path / "m"), loss=loss, save_final_model=False, gradient_checkpointing=False)
    # 3 prompts x 4 completions, one prompt per micro-step: 3 micro-steps per epoch, windows [0, 1] and [2].
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl", num_rows=3), reward_funcs=[length_reward],
                             num_generations=4, per_device_train_batch_size=4, steps_per_generation=1,
                             generation=GenerationParams(max_completion_length=6))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accumulate_grad_batches=2,
                         gradient_clip_val=None, callbacks=[capture], default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    assert trainer.global_step == 2 and capture.batch.accumulation_steps == 1

    batch = capture.batch  # the expected step: this micro-batch alone, as a one-micro-step window
    logps, entropies = completion_logprobs(capture.policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                           batch.completion_mask, batch.temperature, options=module.forward_options)
    expected = module.loss(LossInputs(
        logps=logps, old_logps=None, advantages=batch.advantages, mask=batch.loss_mask, entropies=entropies,
        num_items_in_batch=batch.loss_mask.sum().float(), max_completion_length=batch.max_completion_length,
        num_processes=1, gradient_accumulation_steps=1,
    ))
    expected.loss.backward()
    for actual, reference in zip(capture.grads, (p.grad for p in capture.policy.parameters())):
        # the same float32 computation up to summation order
        torch.testing.assert_close(actual, reference, rtol=1e-4, atol=1e-6)
    assert any(float(g.abs().max()) > 1e-4 for g in capture.grads)

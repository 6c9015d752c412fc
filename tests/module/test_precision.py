"""Generation and the no-grad log-prob passes run with the training forward's precision."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.forward import completion_logprobs
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts
from tests.module.test_forward_paths import reduction_size
from tests.numerics import assert_close_f32, f32_tolerance


def _float32_tolerance(model, batch) -> tuple[int, float]:
    """``(reduction_size, scale)`` of a float32 log-prob forward through ``model`` on ``batch``
    (``tests/numerics.py``): the scale is the largest ``|logit / T|`` plus the O(1) normed states."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    return reduction_size(model, input_ids.shape[1]), float(logits.abs().max()) / batch.temperature + 1.0


class CompareOldLogprobs(pl.Callback):
    def __init__(self) -> None:
        self.checked = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, batch.temperature)
        with torch.no_grad():
            old = pl_module.rollout_logprobs(batch, reference=False, chunk_size=len(batch))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast, _ = completion_logprobs(pl_module.policy, *args, with_entropy=False)
            full, _ = completion_logprobs(pl_module.policy, *args, with_entropy=False)
        mask = batch.completion_mask.bool()
        size, scale = _float32_tolerance(pl_module.policy, batch)
        # the same bf16-autocast computation: equal up to float32 rounding
        assert_close_f32(old[mask], autocast[mask], reduction_size=size, scale=scale)
        # bf16 changes the log-probs by more than float32 rounding explains
        changed = float((old[mask] - full[mask]).abs().max())
        noise = f32_tolerance(reduction_size=size, scale=scale, sides=2)
        assert changed > noise, "bf16 autocast should change the log-probs"
        self.checked = True


def test_old_logprobs_use_the_training_precision(tmp_path):
    check = CompareOldLogprobs()
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", precision="bf16-mixed", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[check])
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    trainer.fit(GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False), data)
    assert check.checked

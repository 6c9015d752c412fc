"""`bf16-true` / `16-true`: Lightning's precision plugin converts each batch (`convert_input`) before
our hooks see it. The batch then is a micro-step descriptor (no tensors); the RolloutBatch is built
afterwards, so its float tensors (advantages, log-probs, token counts) stay float32."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.data.evaluation import EvalRef
from grpo_lightning.data.micro_steps import MicroStepRef
from grpo_lightning.losses import GRPOLoss
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts

FLOAT32_FIELDS = ("advantages", "num_items_in_batch", "old_logps", "ref_logps")


def test_descriptors_pass_through_convert_input():
    plugin = HalfPrecision("bf16-true")
    for ref in (MicroStepRef(3, 0, 1, 1, 0), EvalRef("", 2, (4, 5))):
        assert plugin.convert_input(ref) == ref


class Record(pl.Callback):
    def __init__(self) -> None:
        self.dtypes: list[dict[str, torch.dtype]] = []
        self.losses: list[float] = []
        self.weight_dtype = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.dtypes.append({name: getattr(batch, name).dtype for name in FLOAT32_FIELDS})
        self.weight_dtype = next(pl_module.policy.parameters()).dtype

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("precision, weights", [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_precision_trains_with_float32_batch_tensors(tmp_path, precision, weights):
    record = Record()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", precision=precision, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[record])
    # num_iterations=2 and beta > 0: the batches carry old and reference log-probs
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, num_iterations=2,
                             generation=GenerationParams(max_completion_length=4))
    trainer.fit(GRPOModule(make_model_dir(tmp_path / "m"), loss=GRPOLoss(beta=0.04), save_final_model=False), data)
    assert trainer.global_step == 2 and record.weight_dtype == weights
    assert all(dtype == torch.float32 for step in record.dtypes for dtype in step.values()), record.dtypes
    assert len(record.losses) == 2 and all(math.isfinite(loss) for loss in record.losses)

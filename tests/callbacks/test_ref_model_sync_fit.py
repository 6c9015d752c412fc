"""``RefModelSync`` in a real fit: it mixes once per optimizer step that ``ref_model_sync_steps``
divides (never per micro-batch under accumulation), with the policy of that step, and a run
resumed from the checkpoint of a mixing step ends with the reference of a run that never stopped."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.callbacks import RefModelSync
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.losses import DAPOLoss
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts

ALPHA = 0.6


class RecordWeights(pl.Callback):
    """The reference and policy after each optimizer step (placed after ``RefModelSync``)."""

    def __init__(self) -> None:
        self.ref: dict[int, dict[str, torch.Tensor]] = {}
        self.policy: dict[int, dict[str, torch.Tensor]] = {}

    @staticmethod
    def _copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    def on_train_start(self, trainer, pl_module):
        self.ref[trainer.global_step] = self._copy(pl_module.ref_policy)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ref[trainer.global_step] = self._copy(pl_module.ref_policy)
        self.policy[trainer.global_step] = self._copy(pl_module.policy)


def _fit(model_dir: str, prompts: str, root, max_steps: int, sync_steps: int, ckpt_path: str | None = None):
    pl.seed_everything(0)  # the same sampling in every run (a resumed one restores its RNG from the checkpoint)
    sync, record = RefModelSync(ref_model_mixup_alpha=ALPHA, ref_model_sync_steps=sync_steps), RecordWeights()
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=2, default_root_dir=str(root),
                         callbacks=[sync, record, checkpoint])
    module = GRPOModule(model_dir, loss=DAPOLoss(beta=0.1), learning_rate=2e-2, lr_scheduler_type="constant",
                        gradient_checkpointing=False, save_final_model=False)
    data = RolloutDataModule(prompts, reward_funcs=[length_reward], num_generations=4, per_device_train_batch_size=4,
                             generation=GenerationParams(max_completion_length=4))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return sync, record, module


def _mixed(ref: torch.Tensor, policy: torch.Tensor) -> torch.Tensor:
    return ((1 - ALPHA) * ref.double() + ALPHA * policy.double()).to(ref.dtype)


@pytest.mark.slow
def test_mixes_at_the_right_steps_and_a_resume_continues_exactly(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", num_rows=12)
    straight, record, module = _fit(model_dir, prompts, tmp_path / "a", max_steps=6, sync_steps=3)
    assert (straight.num_syncs, straight.last_synced_step) == (2, 6)
    for step in range(1, 7):
        for name, ref in record.ref[step].items():
            before, policy = record.ref[step - 1][name], record.policy[step][name]
            expected = _mixed(before, policy) if step % 3 == 0 else before
            assert torch.equal(ref, expected), f"step {step}: {name}"
    moved = max(float((record.ref[6][n] - record.ref[0][n]).abs().max()) for n in record.ref[0])
    assert moved > 1e-3, "the reference did not move"

    # Stopped after step 3 (its checkpoint holds the mixed reference), resumed to step 6: under
    # accumulation the first micro-batch after the resume still sees global_step 3, which must
    # not mix a second time.
    _fit(model_dir, prompts, tmp_path / "b", max_steps=3, sync_steps=3)
    resumed, resumed_record, resumed_module = _fit(model_dir, prompts, tmp_path / "b", max_steps=6, sync_steps=3,
                                                   ckpt_path=str(tmp_path / "b/ckpt/epoch=0-step=3.ckpt"))
    assert (resumed.num_syncs, resumed.last_synced_step) == (2, 6)
    for step in range(3, 7):
        for name, ref in resumed_record.ref[step].items():
            assert torch.equal(ref, record.ref[step][name]), f"step {step}: {name}"
    final, expected = resumed_module.ref_policy.state_dict(), module.ref_policy.state_dict()
    assert all(torch.equal(final[k], expected[k]) for k in expected)

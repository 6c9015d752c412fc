"""The whole pipeline on CPU with a tiny model: every loss trains, rollouts are on-policy."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.losses import LOSSES
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward, make_model_dir, write_prompts, built


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return {
        "model": make_model_dir(root / "model"),
        "prompts": write_prompts(root / "prompts.jsonl"),
        "chat_prompts": write_prompts(root / "chat.jsonl", conversational=True),
    }


class RecordBatches(pl.Callback):
    """Records, for every micro-step, the optimizer step it trains at and what the batch holds."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(
            {
                "global_step": trainer.global_step,
                "versions": batch.policy_versions.tolist(),
                "has_old": batch.old_logps is not None,
                "has_ref": batch.ref_logps is not None,
                "iteration": batch.iteration,
                "micro_index": batch.micro_index,
                "rows": len(batch),
            }
        )


def fit(assets, tmp_path, *, loss="dapo", max_steps=2, accumulate=1, callbacks=(), prompts="prompts", **data_kwargs):
    module = GRPOModule(assets["model"], loss=loss, learning_rate=1e-2, lr_scheduler_type="constant")
    data_kwargs = {"num_generations": 4, "per_device_train_batch_size": 8, **data_kwargs}
    datamodule = RolloutDataModule(
        assets[prompts], reward_funcs=[length_reward], generation=GenerationParams(max_completion_length=6), **data_kwargs
    )
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
        default_root_dir=str(tmp_path), callbacks=list(callbacks),
    )
    trainer.fit(module, datamodule)
    return module, datamodule, trainer


def loss_for(name: str):
    kwargs = {"importance_sampling_level": "sequence"} if name == "luspo" else {}
    if name == "cispo":
        kwargs["epsilon_high"] = 5.0
    return LOSSES[name](**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_each_loss_type_trains_two_steps_and_changes_every_parameter(assets, tmp_path, loss_name):
    module = built(GRPOModule(assets["model"], loss=loss_for(loss_name)))
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    module, _, trainer = fit(assets, tmp_path, loss=loss_for(loss_name))
    assert trainer.global_step == 2
    unchanged = [n for n, p in module.policy.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, f"{loss_name}: parameters not updated: {unchanged}"


def test_rollouts_are_generated_by_the_weights_they_train(assets, tmp_path):
    recorder = RecordBatches()
    fit(assets, tmp_path, max_steps=3, callbacks=[recorder])
    assert len(recorder.seen) == 3
    for step in recorder.seen:
        assert set(step["versions"]) == {step["global_step"]}
        assert not step["has_old"] and not step["has_ref"]  # on-policy: no extra forward passes


def test_replayed_buffer_lags_by_exactly_the_planned_steps(assets, tmp_path):
    # 2 micro-batches per generation, each replayed twice, an optimizer step per micro-batch.
    recorder = RecordBatches()
    fit(assets, tmp_path, max_steps=8, callbacks=[recorder], steps_per_generation=2, num_iterations=2,
        per_device_train_batch_size=4)
    for position, step in enumerate(recorder.seen):
        lag = position % 4  # micro-steps since this generation batch was sampled
        assert set(step["versions"]) == {step["global_step"] - lag}
        assert step["has_old"], "old log-probs are needed once the policy moves between replays"
        assert (step["iteration"], step["micro_index"]) == divmod(position % 4, 2)
        assert step["rows"] == 4


def test_accumulation_over_one_generation_batch_needs_no_old_logprobs(assets, tmp_path):
    recorder = RecordBatches()
    _, _, trainer = fit(assets, tmp_path, max_steps=2, accumulate=2, callbacks=[recorder], per_device_train_batch_size=4)
    assert trainer.global_step == 2 and len(recorder.seen) == 4
    assert not any(step["has_old"] for step in recorder.seen)
    assert [s["global_step"] for s in recorder.seen] == [0, 0, 1, 1]
    assert all(set(s["versions"]) == {s["global_step"]} for s in recorder.seen)


def test_kl_loss_builds_a_frozen_reference_and_uses_it(assets, tmp_path):
    recorder = RecordBatches()
    module, _, _ = fit(assets, tmp_path, loss=LOSSES["grpo"](beta=0.1), callbacks=[recorder])
    assert module.ref_policy is not None
    assert all(not p.requires_grad for p in module.ref_policy.parameters())
    assert all(step["has_ref"] for step in recorder.seen)


def test_conversational_prompts_use_the_chat_template(assets, tmp_path):
    _, datamodule, trainer = fit(assets, tmp_path, prompts="chat_prompts", max_steps=1)
    assert trainer.global_step == 1
    batch = datamodule.buffer.batches[0]
    tokenizer = trainer.lightning_module.tokenizer
    text = tokenizer.decode(batch.prompt_ids[0][batch.prompt_mask[0].bool()])
    assert text.startswith("<|user|>") and text.endswith("<|assistant|>")

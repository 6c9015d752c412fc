"""Dynamic sampling in a real ``Trainer.fit`` with a tiny model: no trained row belongs to a tied
group, every step trains the planned rows, the ``dynamic_sampling/*`` metrics reach the logger,
and a run resumed after step 3 (inside a generation batch: ``num_iterations: 2``) trains exactly
what the uninterrupted run trains, with the same extra prompts drawn."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.cli.checkpoints import CheckpointOnException
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.data.dynamic_sampling import DynamicSampling
from grpo_lightning.errors import ConfigError
from grpo_lightning.module import GRPOModule
from grpo_lightning.types import GenerationParams
from tests.helpers import MemoryLogger, make_model_dir, write_prompts


def odd_ties_reward(prompts, completions, **kwargs):
    """Prompts ``a+b=`` with odd ``a`` tie (1.0 for every completion); the others score the
    completion's character codes, which the sampled completions almost never share."""
    return [1.0 if int(p[0]) % 2 else float(sum(map(ord, c))) for p, c in zip(prompts, completions)]


class Record(pl.Callback):
    def __init__(self) -> None:
        self.steps: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        tokenizer = pl_module.tokenizer
        prompts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(batch.prompt_ids, batch.prompt_mask)]
        trained = batch.loss_mask.sum(dim=1) > 0
        self.steps[trainer.global_step] = {
            "rows": len(batch), "prompts": prompts, "trained": trained.tolist(),
            "completions": batch.completion_ids.tolist(), "advantages": batch.advantages.tolist(),
        }


def fit(model_dir, prompts, root, max_steps, ckpt_path=None, dynamic=DynamicSampling(max_extra_rounds=3),
        reward=odd_ties_reward):
    pl.seed_everything(7, verbose=False)  # as `grpo fit` does: the runs sample the same completions
    record, metrics = Record(), MemoryLogger()
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=metrics, log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root),
        callbacks=[record, ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1),
                   CheckpointOnException(str(root / "ckpt" / "on_exception.ckpt"))],
    )
    # A constant learning rate: the 3-step run then takes the 6-step run's first steps exactly.
    module = GRPOModule(model_dir, learning_rate=1e-2, lr_scheduler_type="constant", save_final_model=False)
    data = RolloutDataModule(
        prompts, reward_funcs=[reward], num_generations=4, per_device_train_batch_size=8, num_iterations=2,
        generation=GenerationParams(max_completion_length=4), dynamic_sampling=dynamic,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return record.steps, metrics.by_step(), data


@pytest.mark.slow
def test_dynamic_sampling_trains_no_tied_group_and_resumes_exactly(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", num_rows=12)  # half the prompts have an odd a
    straight, logged, data = fit(model_dir, prompts, tmp_path / "a", max_steps=5)
    for step, seen in straight.items():
        assert seen["rows"] == 8, step  # the planned batch: 2 groups of 4 on one rank
        for prompt, trained in zip(seen["prompts"], seen["trained"]):
            assert not (trained and int(prompt[0]) % 2), f"step {step} trains the tied prompt {prompt!r}"
    rounds = [logged[s]["dynamic_sampling/rounds"] for s in (1, 3, 5)]  # generated at steps 0, 2, 4
    assert all(r >= 1 for r in rounds) and data.refill.batches_drawn == sum(rounds)
    assert any(logged[s]["dynamic_sampling/dropped_groups"] > 0 for s in (1, 3, 5))  # the refill ran
    assert all(logged[s]["frac_reward_zero_std"] == 0 for s in (1, 3, 5))  # over the trained groups only

    fit(model_dir, prompts, tmp_path / "b", max_steps=3)
    resumed, resumed_logged, resumed_data = fit(
        model_dir, prompts, tmp_path / "b", max_steps=5, ckpt_path=str(tmp_path / "b/ckpt/epoch=0-step=3.ckpt"))
    assert sorted(resumed) == [3, 4]  # step 3 replays the checkpoint's generation batch, step 4 generates
    for step in (3, 4):
        assert resumed[step] == straight[step], f"step {step} differs after the resume"
    for step in (4, 5):  # a step's metrics are logged at the optimizer step that ends it
        for name in ("loss", "reward", "dynamic_sampling/rounds", "dynamic_sampling/dropped_groups"):
            if name in logged[step]:
                assert resumed_logged[step][name] == pytest.approx(logged[step][name], rel=1e-6, abs=1e-7), (step, name)
    assert resumed_data.refill.batches_drawn == data.refill.batches_drawn

    # Turning dynamic sampling off (or changing it) on resume is refused by name.
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        fit(model_dir, prompts, tmp_path / "b", max_steps=5, ckpt_path=str(tmp_path / "b/ckpt/epoch=0-step=3.ckpt"),
            dynamic=None)


class FailingTies:
    """``odd_ties_reward`` that fails once, at its ``fail_at``-th call (a judge that timed out)."""

    __name__ = "odd_ties_reward"

    def __init__(self, fail_at=None):
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, prompts, completions, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("judge unavailable (simulated)")
        return odd_ties_reward(prompts, completions, **kwargs)


@pytest.mark.slow
def test_a_failure_in_an_extra_round_resumes_before_the_prompts_that_generation_drew(tmp_path):
    """A reward fails in an extra round of a later generation batch, after that generation drew more
    prompts: ``on_exception.ckpt`` holds the prompt cursor as it was before the generation (with
    the random streams), so the resumed run draws and trains what the uninterrupted run does."""
    model_dir = make_model_dir(tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", num_rows=12)
    straight, logged, data = fit(model_dir, prompts, tmp_path / "a", max_steps=5)
    rounds = [int(logged[s]["dynamic_sampling/rounds"]) for s in (1, 3, 5)]  # generated at steps 0, 2, 4
    later = next(g for g in (1, 2) if rounds[g] >= 2)  # a later generation with an extra round
    with pytest.raises(RuntimeError, match="simulated"):
        fit(model_dir, prompts, tmp_path / "b", max_steps=5, reward=FailingTies(fail_at=sum(rounds[:later]) + 2))
    resumed, _, resumed_data = fit(model_dir, prompts, tmp_path / "b", max_steps=5,
                                   ckpt_path=str(tmp_path / "b/ckpt/on_exception.ckpt"))
    assert sorted(resumed) == list(range(2 * later, 5))
    for step in resumed:
        assert resumed[step] == straight[step], f"step {step} differs after the resume"
    assert resumed_data.refill.batches_drawn == data.refill.batches_drawn

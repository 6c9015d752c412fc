"""The sampler contract (DESIGN.md "Contracts for scale"), exercised with a scripted sampler that
records its calls: version handshake through the WeightSync callback, sampler log-probs carried as
``sampling_logps``, ``ended_on_eos`` deciding truncation, ``Rollout.extra`` reaching rewards,
``close()`` at teardown, lazy registration by dotted path."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning.callbacks import WeightSync
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers import HFGenerateSampler, Sampler, get_sampler, sampler_class
from grpo_lightning.types import GenerationParams, Rollout
from tests.helpers import make_model_dir, write_prompts

SEEN: dict[str, list] = {}


def scripted_reward(completions, turns, **kwargs):
    """Scores ``turns``, a ``Rollout.extra`` field the scripted sampler adds."""
    SEEN.setdefault("turns", []).extend(turns)
    return [float(t) for t in turns]


class ScriptedSampler(Sampler):
    """Returns fixed completions, keeps "its own weights" and records every call.

    Completion ``i`` of a group is ``i + 1`` copies of token 5, then EOS for even ``i``; odd ones
    are reported as cut by the length limit even though their last id is EOS — ``ended_on_eos``,
    not the last id, must decide truncation.
    """

    name = "scripted"
    provides_logprobs = True
    keeps_own_weights = True
    rollout_fields = ("turns",)

    def __init__(self, push: bool = True) -> None:
        super().__init__()
        self.push = push
        self.calls: list[tuple] = []

    def on_policy_updated(self, handle, version):
        self.calls.append(("update", version))
        if self.push:
            super().on_policy_updated(handle, version)

    def push_weights(self, handle, version):
        self.calls.append(("push", version, sum(float(p.detach().sum()) for p in handle.policy.parameters())))

    def generate(self, prompts, num_generations, params):
        self.calls.append(("generate", self.served_version, self.handle.policy_version))
        eos = self.handle.tokenizer.eos_token_id
        rollouts = []
        for prompt in prompts:
            for i in range(num_generations):
                ids = [5] * (i + 1) + [eos]
                rollouts.append(Rollout(list(prompt), ids, ended_on_eos=i % 2 == 0, policy_version=self.served_version,
                                        sampling_logprobs=[-0.5] * len(ids), extra={"turns": i}))
        return rollouts

    def close(self):
        self.calls.append(("close",))


class Record(pl.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.global_step, batch))


def fit(tmp_path, sampler, max_steps=3, **data_kwargs):
    record = Record()
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[record],
                         default_root_dir=str(tmp_path))
    module = GRPOModule(make_model_dir(tmp_path / "m"), learning_rate=1e-2, save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[scripted_reward], num_generations=4,
                             per_device_train_batch_size=8, sampler=sampler,
                             generation=GenerationParams(max_completion_length=8), **data_kwargs)
    trainer.fit(module, data)
    return trainer, record


def test_weights_reach_the_sampler_before_every_generation(tmp_path):
    sampler = ScriptedSampler()
    trainer, record = fit(tmp_path, sampler)
    assert sum(isinstance(c, WeightSync) for c in trainer.callbacks) == 1  # added by the datamodule
    pushes = [c for c in sampler.calls if c[0] == "push"]
    assert [p[1] for p in pushes] == [0, 1, 2, 3]  # at train start, then after every optimizer step
    assert len({p[2] for p in pushes}) == 4  # each push saw new weights
    generations = [c for c in sampler.calls if c[0] == "generate"]
    assert generations == [("generate", v, v) for v in range(3)]  # served version == policy version
    assert sampler.calls[-1] == ("close",)  # teardown
    for step, batch in record.batches:
        assert batch.policy_versions.tolist() == [step] * len(batch)


def test_sampler_logprobs_eos_and_extra_fields_reach_the_batch_and_rewards(tmp_path):
    SEEN.clear()
    _, record = fit(tmp_path, ScriptedSampler(), max_steps=1, mask_truncated_completions=True)
    _, batch = record.batches[0]
    assert batch.sampling_logps is not None
    assert torch.all(batch.sampling_logps[batch.completion_mask.bool()] == -0.5)
    # Odd completions were reported cut (ended_on_eos=False): masked out although they end with
    # EOS; even ones (1 or 3 tokens of 5, then EOS) are kept whole.
    kept = batch.completion_mask.sum(1)
    assert sorted(kept.tolist()) == [0] * 4 + [2, 2, 4, 4]
    assert sorted(SEEN["turns"]) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_sampler_that_misses_its_weights_cannot_generate(tmp_path):
    with pytest.raises(RuntimeError, match=r"serves policy version None .* WeightSync"):
        fit(tmp_path, ScriptedSampler(push=False), max_steps=1)


def test_samplers_by_name_dotted_path_or_instance():
    assert isinstance(get_sampler("hf_generate"), HFGenerateSampler)
    path = f"{__name__}.ScriptedSampler"
    assert sampler_class(path) is ScriptedSampler
    instance = ScriptedSampler()
    assert get_sampler(instance) is instance
    with pytest.raises(ValueError, match="data.sampler"):
        get_sampler("no_such_sampler")
    with pytest.raises(ValueError, match="data.sampler"):
        get_sampler("tests.samplers.test_sampler_contract.scripted_reward")  # not a Sampler


def test_a_resumed_run_pushes_the_restored_weights_before_it_generates(tmp_path):
    """After ``--ckpt_path`` the first push carries the restored step and the restored weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(max_steps, ckpt_path=None):
        sampler = ScriptedSampler()
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
        trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[checkpoint], default_root_dir=str(tmp_path))
        module = GRPOModule(make_model_dir(tmp_path / "m"), learning_rate=1e-2, save_final_model=False)
        data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[scripted_reward],
                                 num_generations=4, per_device_train_batch_size=8, sampler=sampler,
                                 generation=GenerationParams(max_completion_length=8))
        trainer.fit(module, data, ckpt_path=ckpt_path)
        return sampler, module

    first, trained = run(2)
    last_push = [c for c in first.calls if c[0] == "push"][-1]
    resumed, _ = run(4, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    pushes = [c for c in resumed.calls if c[0] == "push"]
    assert pushes[0][1] == 2 and pushes[0][2] == pytest.approx(last_push[2], rel=1e-6)  # restored step and weights
    generations = [c for c in resumed.calls if c[0] == "generate"]
    assert [c[1] for c in generations] == [c[2] for c in generations] == [2, 3]

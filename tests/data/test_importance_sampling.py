"""The builder applies the importance-sampling correction when the sampler reports log-probs:
old log-probs computed at generation time, ``sampling_is_weights`` on the batch, ``sampling/*``
metrics reduced over ranks."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lightning.algo.importance import ImportanceSamplingCorrection
from grpo_lightning.data.rollout_builder import Collective
from tests.data.fake_ranks import EchoSampler, FakeHandle, ThreadRanks, make_builder


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


class LogprobSampler(EchoSampler):
    """EchoSampler's completions, each token reported at log-prob -1."""

    provides_logprobs = True

    def generate(self, prompts, num_generations, params):
        rollouts = super().generate(prompts, num_generations, params)
        for r in rollouts:
            r.sampling_logprobs = [-1.0] * len(r.completion_ids)
        return rollouts


class OldLogprobHandle(FakeHandle):
    """The trainer puts every sampled token at log-prob -0.5: d = 0.5 per token."""

    calls = 0

    def rollout_logprobs(self, batch, *, reference, chunk_size):
        assert not reference
        OldLogprobHandle.calls += 1
        return torch.full(batch.completion_ids.shape, -0.5) * batch.completion_mask


def builder_for(collective, correction=ImportanceSamplingCorrection(), sampler_logprobs=True):
    builder = make_builder([length_reward], collective, handle=OldLogprobHandle(), importance_sampling=correction,
                           sampler_logprobs=sampler_logprobs)
    sampler = LogprobSampler()
    sampler.bind(builder.handle)
    builder.sampler = sampler
    return builder


def rows_for(rank):
    ids = [2 * rank, 2 * rank, 2 * rank + 1, 2 * rank + 1]
    return [{"prompt": "x" * (i + 1)} for i in ids], ids


def test_sequence_mask_weights_and_metrics_over_two_ranks():
    ranks = ThreadRanks(2)

    def build(rank):
        rows, ids = rows_for(rank)
        return builder_for(ranks.collective(rank)).build(rows, ids, None).micro_batches[0]

    batches = ranks.run(build)
    ratios, gaps = [], []
    for batch in batches:
        lengths = batch.completion_mask.sum(1)  # 2..4 tokens (EchoSampler)
        expected = torch.tensor([[math.exp(0.5 * n) if math.exp(0.5 * n) <= 3.0 else 0.0] for n in lengths.tolist()])
        torch.testing.assert_close(batch.sampling_is_weights, expected)
        torch.testing.assert_close(batch.old_logps, -0.5 * batch.completion_mask.float())
        ratios += expected[:, 0].tolist()
        gaps += [0.5] * int(lengths.sum())
    for batch in batches:  # identical on both ranks, over both ranks' rows
        metrics = batch.generation_metrics
        assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(0.5)
        assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(0.5)
        assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(ratios) / len(ratios))
        assert metrics["sampling/importance_sampling_ratio/min"] == 0.0
        assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(max(ratios))


def test_token_truncate_weights_every_token():
    rows, ids = rows_for(0)
    builder = builder_for(Collective(), ImportanceSamplingCorrection(mode="token_truncate", clip_max=1.5))
    batch = builder.build(rows, ids, None).micro_batches[0]
    expected = torch.where(batch.completion_mask.bool(), torch.tensor(1.5), torch.tensor(1.0))  # e^0.5 = 1.65 -> 1.5
    torch.testing.assert_close(batch.sampling_is_weights, expected)
    assert batch.generation_metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.5)


@pytest.mark.parametrize("enabled, sampler_logprobs", [(False, True), (True, False)])
def test_no_correction_and_no_extra_forward_when_off_or_without_sampler_logprobs(enabled, sampler_logprobs):
    rows, ids = rows_for(0)
    OldLogprobHandle.calls = 0
    builder = builder_for(Collective(), ImportanceSamplingCorrection(enabled=enabled), sampler_logprobs)
    batch = builder.build(rows, ids, None).micro_batches[0]
    assert batch.sampling_is_weights is None and batch.old_logps is None
    assert OldLogprobHandle.calls == 0
    assert not any(name.startswith("sampling/") for name in batch.generation_metrics)
    assert batch.sampling_logps is not None  # still carried (OPSM uses them)

"""Fake ranks for data-side tests: builders of several ranks run in threads of one process and
exchange tensors through a barrier, so the collectives are real exchanges (unequal shapes fail
just as they would across processes)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from grpo_lightning.data.prompt_order import GenerationPlan
from grpo_lightning.data.rollout_builder import Collective, RolloutBuilder, RolloutSettings
from grpo_lightning.rewards import RewardRunner, resolve_reward_funcs
from grpo_lightning.samplers.base import Sampler
from grpo_lightning.types import GenerationParams, Rollout
from grpo_lightning.utils.tiny_models import build_char_tokenizer


class ThreadRanks:
    """``world_size`` ranks in threads; :meth:`collective` is one rank's :class:`Collective`."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=30)
        self._slots: list[Any] = [None] * world_size

    def _exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return out

    def collective(self, rank: int) -> Collective:
        return Collective(
            rank, self.world_size,
            all_gather=lambda t: torch.stack(self._exchange(rank, t.clone())),
            all_gather_objects=lambda values: self._exchange(rank, list(values)),
        )  # fmt: skip

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on every rank at once; the results in rank order."""
        with ThreadPoolExecutor(self.world_size) as pool:
            futures = [pool.submit(fn, rank) for rank in range(self.world_size)]
            return [f.result(timeout=60) for f in futures]


class EchoSampler(Sampler):
    """Completion ``j`` of a prompt is ``"a" * (1 + (len(prompt) + j) % 3)`` then EOS: lengths
    differ within a group and depend only on the prompt."""

    def generate(self, prompts, num_generations, params):
        tok = self.handle.tokenizer
        a = tok.convert_tokens_to_ids("a")
        return [
            Rollout(list(p), [a] * (1 + (len(p) + j) % 3) + [tok.eos_token_id], True, self.handle.policy_version)
            for p in prompts
            for j in range(num_generations)
        ]


@dataclass
class FakeHandle:
    """The :class:`PolicyHandle` members the builder uses, without a model."""

    tokenizer: Any = field(default_factory=build_char_tokenizer)
    device: torch.device = torch.device("cpu")
    policy_version: int = 0
    needs_reference_logprobs: bool = False
    max_context_length: int | None = None

    def rollout_logprobs(self, batch, *, reference, chunk_size):
        raise AssertionError("not needed with steps_per_generation == accumulation")


def make_builder(
    reward_funcs: Sequence[Any], collective: Collective, *, num_generations: int = 2, local_rows: int = 4,
    handle: FakeHandle | None = None, max_completion_length: int = 4, **settings: Any,
) -> RolloutBuilder:
    """A builder of one rank whose generation batch is ``local_rows`` rows per rank, one micro-batch."""
    world = collective.world_size
    plan = GenerationPlan(local_rows * world, 1, local_rows * world // num_generations, local_rows)
    rollout_settings = RolloutSettings(
        num_generations=num_generations, plan=plan, params=GenerationParams(max_completion_length=max_completion_length),
        gradient_accumulation_steps=1, **settings,
    )
    handle = handle or FakeHandle()
    sampler = EchoSampler()
    sampler.bind(handle)
    return RolloutBuilder(rollout_settings, sampler, RewardRunner(resolve_reward_funcs(list(reward_funcs))), handle, collective)

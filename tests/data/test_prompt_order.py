"""Generation-batch sizing (spec §1.1) and RepeatSampler prompt order (spec §1.2)."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.data.prompt_order import GenerationPlan, PromptOrder, plan_generation_batches, shuffle_seed


def test_spec_example_seed_42() -> None:
    # 7 items, G=2, batch_size=3, seed=42: [1,1,6,6,3,3 ...], [5,5,4,4,0,0 ...]; epoch 1 starts 5,3,2.
    order = PromptOrder(num_rows=7, prompts_per_generation=3, shuffle=True, seed=42)
    assert order.generations_per_epoch == 2
    assert order.prompt_indices(0, 0) == [1, 6, 3]
    assert order.prompt_indices(0, 1) == [5, 4, 0]
    assert order.prompt_indices(1, 0) == [5, 3, 2]


def test_matches_trl_repeat_sampler_stream() -> None:
    """Expanding our chunks the way RepeatSampler does reproduces its stream over 3 epochs."""
    n, per_gen, g, repeat, seed = 11, 4, 3, 2, 1234
    gen = torch.Generator()
    gen.manual_seed(seed)
    expected: list[int] = []
    for _ in range(3):
        perm = torch.randperm(n, generator=gen).tolist()
        chunks = [perm[i : i + per_gen] for i in range(0, n, per_gen)]
        for chunk in (c for c in chunks if len(c) == per_gen):
            expected += [i for _ in range(repeat) for i in chunk for _ in range(g)]
    order = PromptOrder(n, per_gen, seed=seed)
    ours = [
        i
        for epoch in range(3)
        for k in range(order.generations_per_epoch)
        for _ in range(repeat)
        for i in order.prompt_indices(epoch, k)
        for _ in range(g)
    ]
    assert ours == expected


def test_pure_function_of_position_resume() -> None:
    first = PromptOrder(50, 7, seed=3)
    seen = {(e, k): first.prompt_indices(e, k) for e in range(4) for k in range(7)}
    # A "restarted" instance asked out of order (latest epoch first) gives the same answers.
    resumed = PromptOrder(50, 7, seed=3)
    for e, k in sorted(seen, reverse=True):
        assert resumed.prompt_indices(e, k) == seen[(e, k)]
    assert resumed.prompt_indices(2, 5) == first.prompt_indices(2, 5)


def test_chunks_unique_and_epochs_differ() -> None:
    order = PromptOrder(20, 6, seed=0)
    assert order.generations_per_epoch == 3
    epoch0 = [i for k in range(3) for i in order.prompt_indices(0, k)]
    assert len(set(epoch0)) == 18 and all(0 <= i < 20 for i in epoch0)
    assert order.permutation(0) != order.permutation(1)
    assert sorted(order.permutation(1)) == list(range(20))


def test_no_shuffle_is_dataset_order_and_drops_last() -> None:
    order = PromptOrder(7, 3, shuffle=False)
    assert [order.prompt_indices(e, k) for e in (0, 5) for k in (0, 1)] == [[0, 1, 2], [3, 4, 5]] * 2


def test_out_of_range_generation_index() -> None:
    order = PromptOrder(7, 3)
    with pytest.raises(IndexError):
        order.prompt_indices(0, 2)
    with pytest.raises(ValueError):
        order.prompt_indices(-1, 0)


def test_dataset_smaller_than_generation_batch() -> None:
    with pytest.raises(ValueError) as info:
        PromptOrder(num_rows=2, prompts_per_generation=4)
    msg = str(info.value)
    for key in ("2 prompts", "data.per_device_train_batch_size", "data.num_generations",
                "data.generation_batch_size"):  # fmt: skip
        assert key in msg


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        # neither set: S = GA, gbs = pdbs * P * S
        (dict(per_device_train_batch_size=8, num_generations=8, world_size=1), (8, 1, 1, 8)),
        (dict(per_device_train_batch_size=4, num_generations=4, world_size=2,
              gradient_accumulation_steps=3), (24, 3, 6, 12)),
        # TEST test_train_num_generations_larger_than_batch_size: pdbs=3, G=6, GA=2
        (dict(per_device_train_batch_size=3, num_generations=6, world_size=1,
              gradient_accumulation_steps=2), (6, 2, 1, 6)),
        # only generation_batch_size
        (dict(per_device_train_batch_size=2, num_generations=4, world_size=2,
              generation_batch_size=16), (16, 4, 4, 8)),
        # only steps_per_generation (GA ignored)
        (dict(per_device_train_batch_size=3, num_generations=3, world_size=2,
              steps_per_generation=2, gradient_accumulation_steps=5), (12, 2, 4, 6)),
    ],
)  # fmt: skip
def test_plan_table(kwargs: dict, expected: tuple[int, int, int, int]) -> None:
    plan = plan_generation_batches(**kwargs)
    assert isinstance(plan, GenerationPlan)
    got = (plan.generation_batch_size, plan.steps_per_generation, plan.prompts_per_generation,
           plan.local_rows)  # fmt: skip
    assert got == expected


@pytest.mark.parametrize(
    "kwargs, keys",
    [
        (dict(per_device_train_batch_size=2, num_generations=2, world_size=1,
              generation_batch_size=8, steps_per_generation=4),
         ["data.generation_batch_size", "data.steps_per_generation", "only one"]),
        (dict(per_device_train_batch_size=4, num_generations=2, world_size=2,
              generation_batch_size=12),
         ["data.generation_batch_size=12", "data.per_device_train_batch_size", "multiple of 8"]),
        (dict(per_device_train_batch_size=3, num_generations=4, world_size=1),
         ["data.num_generations=4", "data.per_device_train_batch_size", "divide"]),
        (dict(per_device_train_batch_size=2, num_generations=3, world_size=1,
              gradient_accumulation_steps=2),
         ["data.num_generations=3", "trainer.accumulate_grad_batches", "multiple of 3"]),
        (dict(per_device_train_batch_size=4, num_generations=1, world_size=1),
         ["data.num_generations=1", ">= 2"]),
        (dict(per_device_train_batch_size=0, num_generations=2, world_size=1),
         ["data.per_device_train_batch_size=0"]),
        (dict(per_device_train_batch_size=2, num_generations=2, world_size=1,
              gradient_accumulation_steps=0), ["trainer.accumulate_grad_batches=0"]),
        (dict(per_device_train_batch_size=2, num_generations=2, world_size=0),
         ["trainer.devices"]),
    ],
)  # fmt: skip
def test_plan_errors_name_the_settings(kwargs: dict, keys: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        plan_generation_batches(**kwargs)
    for key in keys:
        assert key in str(info.value)


def test_shuffle_seeds_differ_for_every_rank_epoch_and_generation() -> None:
    grid = [(rank, epoch, generation) for rank in range(8) for epoch in range(10) for generation in range(50)]
    seeds = {shuffle_seed(42, *key) for key in grid}
    assert len(seeds) == len(grid)
    # The old mix ((seed*P + rank)*P + epoch*P + generation) made these two equal.
    assert shuffle_seed(42, 1, 0, 0) != shuffle_seed(42, 0, 1, 0)
    assert shuffle_seed(42, 0, 0, 0) != shuffle_seed(43, 0, 0, 0)
    assert all(0 <= s < 2**63 for s in seeds)
    torch.Generator().manual_seed(max(seeds))  # a valid seed

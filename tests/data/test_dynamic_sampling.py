"""Dynamic sampling (DAPO): tied groups are never trained on, the batch keeps its size, the
refill rounds and their metrics are exact, normalisers cover the trained rows, ranks agree.

A scripted dataset fixes which prompts tie: a row of kind ``tie`` scores 1.0 for every
completion, a row of kind ``vary`` scores its completion's length (EchoSampler's lengths differ
within a group). Prompt order unshuffled: prompt batch ``k`` is rows ``[P*k, P*(k+1))``.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.algo.advantages import compute_advantages
from grpo_lightning.data.dynamic_sampling import DynamicSampler, DynamicSampling, choose_groups, tied_groups
from grpo_lightning.data.prompt_order import GenerationPlan, PromptOrder
from grpo_lightning.data.resume_state import check_same_plan, run_plan
from grpo_lightning.data.rollout_builder import Collective, RolloutBuilder, RolloutSettings
from grpo_lightning.errors import ConfigError
from grpo_lightning.rewards import RewardRunner, resolve_reward_funcs
from grpo_lightning.types import GenerationParams
from tests.data.fake_ranks import EchoSampler, FakeHandle, ThreadRanks

NAN = float("nan")
# Prompt batches of 4: [vary, tie, vary, tie] (2 differ), [tie, tie, vary, tie] (1),
# [vary, vary, tie, vary] (3), then all vary.
KINDS = ["vary", "tie", "vary", "tie", "tie", "tie", "vary", "tie", "vary", "vary", "tie", "vary"] + ["vary"] * 8


def scripted_reward(prompts, completions, kind, log_metric, **kwargs):
    log_metric("row_sum", float(sum(int(p[1:3]) for p in prompts)))
    return [1.0 if k == "tie" else float(len(c)) for c, k in zip(completions, kind)]


def dataset(kinds=KINDS):
    return [{"prompt": f"q{i:02d}?", "kind": k} for i, k in enumerate(kinds)]


class OccurrenceSampler(EchoSampler):
    """EchoSampler whose ``j`` counts a prompt's rows in the call, so that the rows of a group cut
    by a rank boundary (generated one per row) still differ."""

    def generate(self, prompts, num_generations, params):
        seen: dict[tuple[int, ...], int] = {}
        out = []
        for p in prompts:
            for _ in range(num_generations):
                j = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
                out.append(super().generate([p], 1, params)[0])
                out[-1].completion_ids = out[-1].completion_ids[:1] * (1 + (len(p) + j) % 3) + out[-1].completion_ids[-1:]
        return out


def make_sampler(collective=Collective(), *, groups=4, num_generations=2, steps=1, kinds=KINDS, settings=None,
                 sampler_class=EchoSampler, **rollout_settings) -> tuple[DynamicSampler, PromptOrder]:
    """A dynamic sampler of one rank: ``groups`` prompts per generation batch, ``steps`` micro-batches."""
    world = collective.world_size
    rows = groups * num_generations // world
    plan = GenerationPlan(groups * num_generations, steps, groups, rows)
    handle = FakeHandle()
    sampler = sampler_class()
    sampler.bind(handle)
    builder = RolloutBuilder(
        RolloutSettings(num_generations=num_generations, plan=plan, params=GenerationParams(max_completion_length=4),
                        gradient_accumulation_steps=steps, **rollout_settings),
        sampler, RewardRunner(resolve_reward_funcs([scripted_reward])), handle, collective,
    )
    data = dataset(kinds)
    order = PromptOrder(len(data), groups, shuffle=False)
    return DynamicSampler(settings or DynamicSampling(), builder, lambda ids: [data[i] for i in ids]), order


def trained_prompts(batches, handle_tokenizer) -> list[int]:
    """Dataset row of every row that has loss tokens, in batch order."""
    out = []
    for batch in batches:
        for ids, mask, loss in zip(batch.prompt_ids, batch.prompt_mask, batch.loss_mask):
            if loss.sum() > 0:
                out.append(int(handle_tokenizer.decode(ids[mask.bool()])[1:3]))
    return out


def test_the_tie_rule_is_the_groups_whose_advantages_are_all_zero():
    rewards = torch.tensor([[1.0], [1.0], [0.0], [1.0], [NAN], [2.0], [NAN], [NAN]])
    assert tied_groups(rewards, 2).tolist() == [True, False, True, True]  # equal; differ; one scorable; none
    # Two functions: the weighted sums tie in group 0 (1+0 = 0+1), not in group 1; with weights
    # (1, 0) only the first function counts: group 0 differs (1 vs 0), group 1 ties (1 and 1).
    two = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 5.0], [1.0, 7.0]])
    assert tied_groups(two, 2).tolist() == [True, False]
    assert tied_groups(two, 2, [1.0, 0.0]).tolist() == [False, True]
    # GDPO normalises each function per group: group 0's functions differ, so it does not tie.
    assert tied_groups(two, 2, None, "normalize_then_sum").tolist() == [False, False]
    assert tied_groups(two, 2, [1.0, 0.0], "normalize_then_sum").tolist() == [False, True]
    # Whatever the scaling, a tied group's advantages are 0 and the others' are not all 0.
    torch.manual_seed(0)
    matrix = torch.randint(0, 3, (24, 2)).float()
    matrix[4:8] = torch.tensor([2.0, 1.0])  # group 1 ties in both functions
    for scale in ("group", "batch", "none"):
        for aggregation in ("sum_then_normalize", "normalize_then_sum"):
            tied = tied_groups(matrix, 4, [1.0, 0.5], aggregation)
            advantages = compute_advantages(matrix.double(), 4, [1.0, 0.5], scale, aggregation).view(-1, 4)
            assert tied[1] and tied.sum() < len(tied)
            assert torch.allclose(advantages[tied], torch.zeros_like(advantages[tied]), atol=1e-9)
            assert (advantages[~tied].abs().amax(dim=1) > 1e-3).all()


def test_choose_groups_keeps_draw_order_and_pads_with_the_first_tied_groups():
    tied = [torch.tensor([False, True, False, True]), torch.tensor([True, True, False, True])]
    choice = choose_groups(tied, 4)
    assert choice.picks == [(0, 0), (0, 2), (1, 2), (0, 1)]
    assert (choice.rounds, choice.dropped, choice.surplus, choice.padded) == (2, 5, 0, 1)


def test_refill_drops_tied_groups_and_keeps_the_batch_size():
    dynamic, order = make_sampler(steps=2)
    built = dynamic.build(order, None)
    tokenizer = dynamic.builder.handle.tokenizer
    # Round 1 keeps rows 0, 2; round 2 keeps row 6; round 3 keeps 8 (then 9 and 11 are surplus).
    assert [len(b) for b in built.micro_batches] == [4, 4]  # G=2 x 4 groups in 2 micro-batches
    assert trained_prompts(built.micro_batches, tokenizer) == [0, 0, 2, 2, 6, 6, 8, 8]
    metrics = built.micro_batches[0].generation_metrics
    assert {k: v for k, v in metrics.items() if k.startswith("dynamic_sampling/")} == {
        "dynamic_sampling/rounds": 3.0, "dynamic_sampling/dropped_groups": 6.0,
        "dynamic_sampling/surplus_groups": 2.0, "dynamic_sampling/padded_groups": 0.0,
    }
    assert metrics["frac_reward_zero_std"] == 0.0  # the trained batch has no tied group
    assert metrics["row_sum"] == (12 + 44 + 76) / 3  # log_metric: every round's value (2 x rows 0-3, 4-7, 8-11)
    assert dynamic.batches_drawn == 3
    loss_tokens = sum(float(b.loss_mask.sum()) for b in built.micro_batches)
    for batch in built.micro_batches:  # GA = S: one optimizer step trains this whole batch
        assert float(batch.num_items_in_batch) == loss_tokens
    # The next generation batch continues the order where the last round stopped: prompt batch 3.
    following = dynamic.build(order, None)
    assert trained_prompts(following.micro_batches, tokenizer) == [r for r in range(12, 16) for _ in range(2)]
    assert following.micro_batches[0].generation_metrics["dynamic_sampling/rounds"] == 1.0
    assert dynamic.batches_drawn == 4


def test_at_the_cap_tied_groups_fill_the_batch_without_being_trained_on():
    dynamic, order = make_sampler(settings=DynamicSampling(max_extra_rounds=1))
    (batch,) = dynamic.build(order, None).micro_batches
    tokenizer = dynamic.builder.handle.tokenizer
    assert len(batch) == 8
    assert trained_prompts([batch], tokenizer) == [0, 0, 2, 2, 6, 6]
    filler = batch.loss_mask.sum(dim=1) == 0
    assert filler.tolist() == [False] * 6 + [True] * 2  # the first tied group (row 1), at the end
    assert batch.advantages[filler].abs().sum() == 0
    assert float(batch.num_items_in_batch) == float(batch.loss_mask.sum())  # the trained rows' tokens
    metrics = batch.generation_metrics
    assert (metrics["dynamic_sampling/rounds"], metrics["dynamic_sampling/dropped_groups"],
            metrics["dynamic_sampling/padded_groups"], metrics["dynamic_sampling/surplus_groups"]) == (2, 5, 1, 0)
    # Reward metrics cover the trained rows only: EchoSampler's lengths with EOS are 2 and 3 per group
    # (prompts of 4 characters), so every trained group scores 2 and 3; a filler's 1.0 is not counted.
    assert metrics["reward"] == pytest.approx(2.5) and metrics["frac_reward_zero_std"] == 0.0
    assert metrics["completions/mean_length"] == pytest.approx(3.5)  # with EOS; the filler's rows not counted

    strict, order = make_sampler(settings=DynamicSampling(max_extra_rounds=1, on_exhausted="error"))
    with pytest.raises(ConfigError, match=r"only 3 of the 4 groups.*data\.dynamic_sampling\.max_extra_rounds"):
        strict.build(order, None)


def test_without_ties_the_batch_is_the_plain_builders():
    kinds = ["vary"] * 8
    dynamic, order = make_sampler(kinds=kinds, steps=2)
    plain, _ = make_sampler(kinds=kinds, steps=2)
    data = dataset(kinds)
    row_ids = plain.builder.local_row_ids(order.prompt_indices(0, 0))
    expected = plain.builder.build([data[i] for i in row_ids], row_ids, torch.Generator().manual_seed(3))
    got = dynamic.build(order, torch.Generator().manual_seed(3))
    for a, b in zip(got.micro_batches, expected.micro_batches):
        for name in ("prompt_ids", "completion_ids", "completion_mask", "advantages", "num_items_in_batch"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    dynamic_metrics = {k: v for k, v in got.micro_batches[0].generation_metrics.items() if not k.startswith("dynamic")}
    assert dynamic_metrics == expected.micro_batches[0].generation_metrics
    assert got.num_tokens == expected.num_tokens


def test_batch_scaling_uses_the_std_of_the_trained_batch():
    dynamic, order = make_sampler(scale_rewards="batch")
    (batch,) = dynamic.build(order, None).micro_batches
    # Trained groups (rows 0, 2, 6, 8) each score [2, 3] (see above): the batch std of the kept
    # rewards, not of everything sampled (which includes the tied 1.0s).
    kept = torch.tensor([2.0, 3.0] * 4, dtype=torch.float64)
    expected = compute_advantages(kept.unsqueeze(1), 2, scale_rewards="batch")
    assert torch.allclose(batch.advantages.double(), expected, atol=1e-6)
    assert float(batch.advantages.abs()[0]) == pytest.approx(0.5 / (float(kept.std()) + 1e-4), rel=1e-6)


@pytest.mark.parametrize("num_generations", [2, 4], ids=["whole-groups", "straddling-groups"])
def test_two_ranks_train_the_same_groups_as_one(num_generations):
    # G=2: 4 groups, 4 rows per rank. G=4: 3 groups, 6 rows per rank, so the second group of every
    # round is cut by the rank boundary (its rows are generated one by one: OccurrenceSampler).
    groups = 4 if num_generations == 2 else 3
    kinds = KINDS if num_generations == 2 else ["vary", "tie", "tie", "tie", "tie", "vary", "tie", "vary"] + ["vary"] * 4
    options = dict(groups=groups, num_generations=num_generations, kinds=kinds, sampler_class=OccurrenceSampler)
    single, order = make_sampler(**options)
    (alone,) = single.build(order, None).micro_batches
    ranks = ThreadRanks(2)

    def build(rank):
        dynamic, order = make_sampler(ranks.collective(rank), **options)
        return dynamic.build(order, None).micro_batches[0], dynamic.batches_drawn

    (first, drawn0), (second, drawn1) = ranks.run(build)
    tokenizer = single.builder.handle.tokenizer
    assert len(first) == len(second) == len(alone) // 2  # every rank keeps its share of the batch
    both = trained_prompts([first], tokenizer) + trained_prompts([second], tokenizer)
    assert both == trained_prompts([alone], tokenizer)
    assert both == ([0, 0, 2, 2, 6, 6, 8, 8] if num_generations == 2 else [0] * 4 + [5] * 4 + [7] * 4)
    assert drawn0 == drawn1 == single.batches_drawn == 3
    assert first.generation_metrics == second.generation_metrics  # every rank logs the same values
    loss_tokens = float(first.loss_mask.sum() + second.loss_mask.sum())
    assert float(first.num_items_in_batch) == float(second.num_items_in_batch) == loss_tokens
    for name, value in alone.generation_metrics.items():
        if name.startswith("dynamic_sampling/"):
            assert first.generation_metrics[name] == value, name
    if num_generations == 2:  # the same rows as one rank generates: the same batch, split in two
        assert torch.equal(torch.cat([first.advantages, second.advantages]), alone.advantages)
        assert float(first.num_items_in_batch) == float(alone.num_items_in_batch)
        for name, value in alone.generation_metrics.items():
            expected = value / 2 if name == "row_sum" else value  # each rank logs the sum of its own rows
            assert first.generation_metrics[name] == pytest.approx(expected), name


def test_resume_position_and_the_plan():
    dynamic, order = make_sampler()
    dynamic.build(order, None)
    again, order2 = make_sampler()
    again.load_state_dict(dynamic.state_dict())
    a, b = dynamic.build(order, None).micro_batches[0], again.build(order2, None).micro_batches[0]
    assert torch.equal(a.prompt_ids, b.prompt_ids) and a.generation_metrics == b.generation_metrics

    plan = GenerationPlan(8, 1, 4, 8)
    on = run_plan(["a", "b"], 2, plan, 8, 1, 1, 1, True, DynamicSampling(max_extra_rounds=2))
    off = run_plan(["a", "b"], 2, plan, 8, 1, 1, 1, True, None)
    assert on["dynamic_sampling"] == {"max_extra_rounds": 2, "on_exhausted": "pad"}
    check_same_plan(on, on)
    with pytest.raises(ConfigError, match=r"dynamic_sampling: None in the checkpoint, \{'max_extra_rounds': 2"):
        check_same_plan(off, on)
    older = {k: v for k, v in off.items() if k != "dynamic_sampling"}  # a checkpoint from before the setting
    check_same_plan(older, off)
    with pytest.raises(ConfigError, match="dynamic_sampling: None in the checkpoint"):
        check_same_plan(older, on)


@pytest.mark.parametrize("bad, match", [
    (dict(max_extra_rounds=-1), r"data\.dynamic_sampling\.max_extra_rounds=-1: it must be an integer >= 0"),
    (dict(max_extra_rounds=1.5), r"max_extra_rounds=1\.5"),
    (dict(on_exhausted="skip"), r"data\.dynamic_sampling\.on_exhausted='skip': choose one of \['pad', 'error'\]"),
])
def test_bad_settings_name_the_setting(bad, match):
    with pytest.raises(ConfigError, match=match):
        DynamicSampling(**bad)


def test_the_yaml_setting_reaches_the_datamodule(tmp_path, capsys):
    import yaml

    from grpo_lightning.cli import main
    from grpo_lightning.data import RolloutDataModule
    from tests.helpers import length_reward, make_model_dir, write_prompts

    config = {"trainer": {"max_steps": 1, "accelerator": "cpu", "default_root_dir": str(tmp_path / "run")},
              "model": {"model": make_model_dir(tmp_path / "model")},
              "data": {"dataset": write_prompts(tmp_path / "p.jsonl"), "reward_funcs": ["tests.helpers.length_reward"],
                       "num_generations": 4, "per_device_train_batch_size": 8, "dynamic_sampling": {"max_extra_rounds": 2}}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code == 0
    printed = "\n".join(line for line in capsys.readouterr().out.splitlines() if not line.startswith("["))  # no log lines
    assert yaml.safe_load(printed)["data"]["dynamic_sampling"] == {"max_extra_rounds": 2, "on_exhausted": "pad"}
    assert RolloutDataModule(config["data"]["dataset"], [length_reward]).dynamic_sampling is None  # off by default

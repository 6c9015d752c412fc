"""``model.top_entropy_quantile``: the module's top-entropy token selection (spec §3.10)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning.losses import LossInputs, top_entropy_mask
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.entropy_selection import EntropyWindow
from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
from grpo_lightning.types import RolloutBatch
from tests.helpers import make_model_dir, write_prompts


def tiny_module(tmp_path, **kwargs) -> GRPOModule:
    module = GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False, **kwargs)
    module.configure_model()
    module._trainer = SimpleNamespace(world_size=1, training=True, accumulate_grad_batches=1)
    return module


def rollout_batch(truncated_row: int | None = None) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    rows, prompt, width = 4, 3, 6
    completion_mask = (torch.arange(width) < torch.tensor([6, 4, 5, 2]).unsqueeze(1)).long()
    if truncated_row is not None:  # what data.mask_truncated_completions does to a truncated row
        completion_mask[truncated_row] = 0
    return RolloutBatch(
        prompt_ids=torch.randint(4, 16, (rows, prompt), generator=g), prompt_mask=torch.ones(rows, prompt).long(),
        completion_ids=torch.randint(4, 16, (rows, width), generator=g) * completion_mask,
        completion_mask=completion_mask, advantages=torch.tensor([1.0, -0.5, 0.25, -1.0]),
        num_items_in_batch=completion_mask.sum().float(), policy_versions=torch.zeros(rows, dtype=torch.long),
    )


@pytest.mark.parametrize("truncated_row", [None, 0])
def test_the_loss_trains_on_the_top_quantile_tokens_of_the_micro_batch(tmp_path, truncated_row):
    module = tiny_module(tmp_path, top_entropy_quantile=0.25, entropy_coef=0.1, forward=ForwardOptions.plain())
    batch = rollout_batch(truncated_row)
    out = module._policy_loss(batch, None)

    logps, entropies = completion_logprobs(module.policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                           batch.completion_mask, 1.0, options=ForwardOptions.plain())
    active = batch.loss_mask.bool()
    values = entropies[active].double().sort().values  # the active tokens' entropies, by hand
    n = len(values)
    rank = 0.75 * (n - 1)
    lo = int(rank)
    threshold = values[lo] + (rank - lo) * (values[min(lo + 1, n - 1)] - values[lo])
    expected_mask = (entropies.double() >= threshold) & active
    assert int(expected_mask.sum()) == n - math.ceil(rank)  # distinct random entropies: the top quarter
    assert torch.equal(top_entropy_mask(entropies, batch.loss_mask, 0.25), expected_mask)
    if truncated_row is not None:
        assert not expected_mask[truncated_row].any()

    reference = module.loss(LossInputs(logps=logps, old_logps=None, advantages=batch.advantages, mask=batch.loss_mask,
                                       entropies=entropies, entropy_coef=0.1, entropy_mask=expected_mask,
                                       num_items_in_batch=batch.num_items_in_batch))
    assert torch.allclose(out.loss, reference.loss, rtol=1e-6, atol=1e-7)
    unmasked = module.loss(LossInputs(logps=logps, old_logps=None, advantages=batch.advantages, mask=batch.loss_mask,
                                      entropies=entropies, entropy_coef=0.1, num_items_in_batch=batch.num_items_in_batch))
    assert not torch.allclose(out.loss, unmasked.loss)  # the selection changes the loss
    # the logged entropy is over every active token, not the selected subset (spec §4.2)
    assert out.metrics["entropy"].local() == pytest.approx(float(entropies[active].mean()), rel=1e-6)


def test_quantile_one_keeps_every_token(tmp_path):
    module = tiny_module(tmp_path, forward=ForwardOptions.plain())
    batch = rollout_batch()
    full = module._policy_loss(batch, None).loss
    module.loss_terms = type(module.loss_terms)(top_entropy_quantile=0.0)  # only the max-entropy token(s)
    assert not torch.allclose(full, module._policy_loss(batch, None).loss)


def test_the_entropy_window_sums_the_selected_tokens_of_training_micro_steps(tmp_path):
    module = tiny_module(tmp_path, top_entropy_quantile=0.5, forward=ForwardOptions.plain())
    module.entropy_window = EntropyWindow()
    batch = rollout_batch()
    module._policy_loss(batch, None)
    module._policy_loss(batch, None)
    _, entropies = completion_logprobs(module.policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                       batch.completion_mask, 1.0, options=ForwardOptions.plain())
    selected = top_entropy_mask(entropies, batch.loss_mask, 0.5)
    total, count = module.entropy_window.take()
    assert count == 2 * int(selected.sum())
    assert total == pytest.approx(2 * float(entropies[selected].sum()), rel=1e-5)
    assert module.entropy_window.take() == (0.0, 0.0)  # reset
    module._trainer.training = False  # evaluation never feeds the controller
    module._policy_loss(batch, None)
    assert module.entropy_window.take() == (0.0, 0.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_entropy_quantile=1.5), r"model.top_entropy_quantile=1.5: it must be in \[0, 1\]"),
        (dict(top_entropy_quantile=-0.1), r"model.top_entropy_quantile=-0.1"),
        (dict(top_entropy_quantile=0.2, forward=ForwardOptions(train_token_budget=64)),
         r"top_entropy_quantile=0.2 with model.forward.train_token_budget=64.*Set model.forward.train_token_budget"),
    ],
)
def test_bad_settings_are_refused_at_construction(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOModule(make_model_dir(tmp_path / "m"), **kwargs)


@pytest.mark.slow
def test_a_run_with_the_entropy_filter_trains(tmp_path):
    """TRL's test_train_with_entropy_filter: top_entropy_quantile=0.2 trains and changes the policy."""
    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import length_reward

    module = GRPOModule(make_model_dir(tmp_path / "m"), top_entropy_quantile=0.2, learning_rate=1e-2,
                        save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    module.configure_model()
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer.fit(module, data)
    assert trainer.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    assert "entropy" in module.step_metrics

"""A micro-batch scored in parts (token-budget training passes) gives the micro-batch's loss,
gradient and metrics exactly, for every loss type and pipeline option."""

from __future__ import annotations

import warnings

import pytest
import torch

from grpo_lightning.losses import LOSSES, LossInputs, MicroBatchTotals, get_loss, merge_metrics

B, T = 6, 7
CONFIGS = [
    {},
    {"importance_sampling_level": "sequence"},
    {"beta": 0.05},
    {"off_policy_mask_threshold": 0.01},
]


def _inputs(seed: int, entropy_coef: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[:, 0] = 1.0
    mask[2] = 0.0  # a fully masked row (masked truncation)
    logps = -torch.rand(B, T, generator=g) * 2
    return dict(
        logps=logps,
        old_logps=logps + 0.2 * torch.randn(B, T, generator=g),
        advantages=torch.randn(B, generator=g),
        mask=mask,
        ref_logps=logps + 0.1 * torch.randn(B, T, generator=g),
        sampling_logps=logps + 0.3 * torch.randn(B, T, generator=g),
        sampling_is_weights=torch.rand(B, T, generator=g) + 0.5,
        entropies=torch.rand(B, T, generator=g) * 3,
        num_items_in_batch=torch.tensor(float(mask.sum() * 3)),
        max_completion_length=T,
        gradient_accumulation_steps=3,
        entropy_coef=entropy_coef,
    )


def _run(loss, fields: dict, rows: torch.Tensor, totals: MicroBatchTotals | None):
    logps = fields["logps"][rows].clone().requires_grad_(True)
    entropies = fields["entropies"][rows].clone().requires_grad_(True)
    picked = {
        k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() >= 1 else v)
        for k, v in fields.items()
        if k not in ("logps", "entropies")
    }
    out = loss(LossInputs(logps=logps, entropies=entropies, totals=totals, **picked))
    out.loss.backward()
    entropy_grad = entropies.grad if entropies.grad is not None else torch.zeros_like(entropies)
    return out, logps.grad, entropy_grad


@pytest.mark.parametrize("loss_type", sorted(LOSSES))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(c) or "default")
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_parts_sum_to_the_micro_batch(loss_type: str, config: dict, entropy_coef: float):
    if loss_type == "vespo" and config.get("importance_sampling_level") == "sequence":
        pytest.skip("vespo expects token-level ratios")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # advice about ratio levels, not what this test checks
        loss = get_loss(loss_type, **config)
    fields = _inputs(seed=len(loss_type), entropy_coef=entropy_coef)
    whole, whole_grad, whole_entropy_grad = _run(loss, fields, torch.arange(B), None)

    totals = MicroBatchTotals.of(fields["mask"])
    parts = [torch.tensor([4, 0]), torch.tensor([2, 5, 1]), torch.tensor([3])]
    grad = torch.zeros(B, T)
    entropy_grad = torch.zeros(B, T)
    outputs = []
    for rows in parts:
        out, part_grad, part_entropy_grad = _run(loss, fields, rows, totals)
        grad[rows] = part_grad
        entropy_grad[rows] = part_entropy_grad
        outputs.append(out)

    total_loss = sum(float(o.loss.detach()) for o in outputs)
    assert total_loss == pytest.approx(float(whole.loss), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(entropy_grad, whole_entropy_grad, rtol=1e-5, atol=1e-7)
    merged = merge_metrics([o.metrics for o in outputs])
    assert merged.keys() == whole.metrics.keys()
    for name, value in whole.metrics.items():
        assert merged[name].local() == pytest.approx(value.local(), rel=1e-5, abs=1e-6, nan_ok=True), name


def test_entropy_mask_needs_bonus_tokens():
    fields = _inputs(seed=0, entropy_coef=0.01)
    entropy_mask = (fields["entropies"] > 1.0).float()
    loss = get_loss("grpo")
    inputs = dict(fields, logps=fields["logps"].requires_grad_(True), entropy_mask=entropy_mask)
    whole = loss(LossInputs(**inputs))
    with_bonus = loss(LossInputs(**inputs, totals=MicroBatchTotals.of(fields["mask"], entropy_mask)))
    assert float(with_bonus.loss.detach()) == pytest.approx(float(whole.loss.detach()))
    with pytest.raises(ValueError, match="bonus_tokens"):
        loss(LossInputs(**inputs, totals=MicroBatchTotals.of(fields["mask"])))

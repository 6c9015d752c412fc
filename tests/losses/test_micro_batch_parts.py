"""A micro-batch scored in parts (token-budget training passes) gives the micro-batch's loss,
gradient and metrics exactly, for every loss type and pipeline option.

"Exactly" up to float32 rounding (``tests/numerics.py``): both sides sum the same ``B·T`` token
terms in float32, in a different grouping.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from grpo_lightning.losses import LOSSES, LossInputs, MicroBatchTotals, get_loss, merge_metrics
from tests.numerics import assert_close_f32

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


def _term_scale(fields: dict) -> float:
    """A bound on a token's term in the loss and the metrics (what float32 rounds): |A| times the
    largest importance ratio, IS weight and ``max(1, |ℓ|)`` (CISPO multiplies by ``ℓ``), plus the
    entropy bonus and the KL term; at least 1 for the fractions and means of O(1) values."""
    logps, mask = fields["logps"], fields["mask"].bool()
    ratio = math.exp(float((logps - fields["old_logps"])[mask].abs().max()))
    kl = math.exp(float((fields["ref_logps"] - logps)[mask].abs().max()))
    policy = float(fields["advantages"].abs().max()) * ratio * float(fields["sampling_is_weights"].max())
    policy *= max(1.0, float(logps.abs().max()))
    return max(1.0, policy + fields["entropy_coef"] * float(fields["entropies"].max()) + kl)


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


# bnpo's two normalisers: the optimizer step's tokens (default) and TRL's micro-batch tokens.
LOSS_TYPES = sorted(LOSSES) + ["bnpo:micro_batch"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(c) or "default")
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_parts_sum_to_the_micro_batch(loss_type: str, config: dict, entropy_coef: float):
    if loss_type == "vespo" and config.get("importance_sampling_level") == "sequence":
        pytest.skip("vespo expects token-level ratios")
    loss_type, _, normalizer = loss_type.partition(":")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # advice about ratio levels, not what this test checks
        loss = get_loss(loss_type, **config, **({"normalizer": normalizer} if normalizer else {}))
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

    # The loss and the metrics sum the B·T token terms (the loss / N, N ≥ the token count); the
    # gradients are per token, through sums over a row's T tokens at sequence level.
    tokens, scale = B * T + len(parts), _term_scale(fields)
    total_loss = sum(float(o.loss.detach()) for o in outputs)
    loss_scale = scale * float(fields["mask"].sum() / fields["num_items_in_batch"])
    assert_close_f32(total_loss, float(whole.loss), reduction_size=tokens, scale=loss_scale, sides=2, msg="loss")
    for name, got, want in (("grad", grad, whole_grad), ("entropy grad", entropy_grad, whole_entropy_grad)):
        assert_close_f32(got, want, reduction_size=T, scale=float(want.abs().max()), sides=2, msg=name)
    merged = merge_metrics([o.metrics for o in outputs])
    assert merged.keys() == whole.metrics.keys()
    for name, value in whole.metrics.items():
        assert_close_f32(merged[name].local(), value.local(), reduction_size=tokens, scale=scale, sides=2,
                         nan_ok=True, msg=name)


def test_entropy_mask_needs_bonus_tokens():
    fields = _inputs(seed=0, entropy_coef=0.01)
    entropy_mask = (fields["entropies"] > 1.0).float()
    loss = get_loss("grpo")
    inputs = dict(fields, logps=fields["logps"].requires_grad_(True), entropy_mask=entropy_mask)
    whole = loss(LossInputs(**inputs))
    with_bonus = loss(LossInputs(**inputs, totals=MicroBatchTotals.of(fields["mask"], entropy_mask)))
    loss_scale = _term_scale(fields) * float(fields["mask"].sum() / fields["num_items_in_batch"])
    assert_close_f32(with_bonus.loss, whole.loss, reduction_size=B * T, scale=loss_scale)
    with pytest.raises(ValueError, match="bonus_tokens"):
        loss(LossInputs(**inputs, totals=MicroBatchTotals.of(fields["mask"])))

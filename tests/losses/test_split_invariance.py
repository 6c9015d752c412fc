"""One optimizer step, one gradient, whatever the split (issue 10), on plain tensors.

A batch of 8 sequences is the whole optimizer step. It is scored as (a) one micro-batch on one
process, (b) 2 accumulated micro-batches of 4, (c) 2 ranks × 2 accumulated micro-batches of 2.
Accumulation sums the micro-steps' gradients; DDP averages the ranks' sums. ``num_items_in_batch``
is the step's token count on all ranks, as the datamodule stamps it. Every loss type's step
gradient must be the same in the three layouts. The halves have different token counts, so a
per-micro-batch token mean (bnpo ``normalizer="micro_batch"``, TRL 1.16) is not invariant; that
is checked too, so the comparison is not vacuous.

Everything is float64: the tolerance is the float64 rounding of sums over the ``B·T`` token
terms (``tests/numerics.py``), far below the ~1e-2 relative change a wrong normaliser makes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from grpo_lightning.losses import LOSSES, LossInputs, get_loss
from tests.numerics import assert_close_f32

B, T = 8, 6
# (rank, micro-step) -> rows: the two layouts besides the whole batch
LAYOUTS = {
    "1 process x 2 micro-steps": {(0, 0): [0, 1, 2, 3], (0, 1): [4, 5, 6, 7]},
    "2 processes x 2 micro-steps": {(0, 0): [0, 1], (0, 1): [2, 3], (1, 0): [4, 5], (1, 1): [6, 7]},
}


def _fields() -> dict:
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([6, 5, 6, 4, 1, 2, 0, 3])  # first half 21 tokens, second 6
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    return dict(
        logps=logps,
        old_logps=logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        ref_logps=logps + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64),
        advantages=torch.randn(B, generator=g, dtype=torch.float64),
        mask=mask,
        max_completion_length=T,
    )


def _step_gradient(loss, fields: dict, layout: dict[tuple[int, int], list[int]]) -> torch.Tensor:
    """The gradient w.r.t. ``logps`` one optimizer step applies: per rank the sum over its
    micro-steps, then the mean over ranks (DDP)."""
    ranks = 1 + max(rank for rank, _ in layout)
    steps = 1 + max(step for _, step in layout)
    num_items = fields["mask"].sum()  # the whole step, all ranks
    grad = torch.zeros(B, T, dtype=torch.float64)
    for (rank, _), rows in layout.items():
        logps = fields["logps"][rows].clone().requires_grad_(True)
        picked = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in fields.items() if k != "logps"}
        out = loss(LossInputs(logps=logps, num_items_in_batch=num_items, num_processes=ranks,
                              gradient_accumulation_steps=steps, **picked))
        out.loss.backward()
        grad[rows] += logps.grad / ranks
    return grad


def _loss(loss_type: str, **knobs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # advice about ratio levels, not what this test checks
        return get_loss(loss_type, **knobs)


@pytest.mark.parametrize("beta", [0.0, 0.1], ids=["no_kl", "kl"])
@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_step_gradient_does_not_depend_on_the_split(loss_type: str, beta: float):
    knobs = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    loss = _loss(loss_type, beta=beta, **knobs)
    fields = _fields()
    whole = _step_gradient(loss, fields, {(0, 0): list(range(B))})
    assert whole.abs().max() > 1e-3
    for name, layout in LAYOUTS.items():
        got = _step_gradient(loss, fields, layout)
        # a gradient entry sums at most a row's T terms (sequence level) and is rounded a few times
        assert_close_f32(got, whole, reduction_size=B * T, scale=float(whole.abs().max()), dtype=torch.float64,
                         msg=f"{loss_type} {name}")


def test_bnpo_micro_batch_normaliser_depends_on_the_split():
    """TRL 1.16's bnpo (``normalizer="micro_batch"``) divides each micro-batch by its own tokens:
    with halves of 21 and 6 tokens the step gradient changes by a large factor."""
    fields = _fields()
    trl_like = _loss("bnpo", normalizer="micro_batch")
    whole = _step_gradient(trl_like, fields, {(0, 0): list(range(B))})
    step = _step_gradient(_loss("bnpo"), fields, {(0, 0): list(range(B))})
    assert_close_f32(step, whole, reduction_size=B * T, scale=float(whole.abs().max()), dtype=torch.float64)
    for layout in LAYOUTS.values():
        split = _step_gradient(trl_like, fields, layout)
        assert float((split - whole).abs().max()) > 0.1 * float(whole.abs().max())


def test_bnpo_step_equals_dapo_when_one_generation_batch_is_one_step():
    """With ``N`` = the step's tokens, bnpo's default normaliser is dapo's: the same loss."""
    fields = _fields()
    for layout in LAYOUTS.values():
        assert torch.equal(_step_gradient(_loss("bnpo"), fields, layout), _step_gradient(_loss("dapo"), fields, layout))


def test_unknown_bnpo_normalizer_is_refused():
    with pytest.raises(ValueError, match="normalizer='token'.*step.*micro_batch"):
        get_loss("bnpo", normalizer="token")

"""Hand-computed loss cases, edge cases, the registry, validation and the metric records."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from grpo_lightning.losses import (
    LOSSES,
    BNPOLoss,
    CISPOLoss,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    LossInputs,
    LossOutput,
    LUSPOLoss,
    PolicyLoss,
    SAPOLoss,
    VESPOLoss,
    get_loss,
    policy_loss,
    top_entropy_mask,
)
from grpo_lightning.types import MetricValue
from tests.numerics import f32_tolerance

# The hand cases run in float64 (their exact values hold to ~1e-15); only the metrics are float32,
# one rounding of values of magnitude ≤ 4: a float32 tolerance at scale 1 bounds every comparison.
TOL = f32_tolerance(reduction_size=1, scale=1.0)


def _flat(x):
    """Flatten nested lists so that ``pytest.approx`` can compare them."""
    return [v for row in x for v in row] if x and isinstance(x[0], list) else list(x)


# ---- a 2x2 case done by hand -------------------------------------------------------------------
# Ratios c1 = exp(ℓ − ℓ_old): row 0 = [1.5, 0.9] with A = +1, row 1 = [0.5, 1.0] with A = −1;
# the last token of row 1 is padding. ε = 0.2, so the clip range is [0.8, 1.2].
#   row 0: t0 → −min(1.5, 1.2) = −1.2 (clipped, no grad); t1 → −0.9 (unclipped, dL/dℓ = −c1 = −0.9)
#   row 1: t0 → −min(−0.5, −0.8) = 0.8 (clipped, no grad); t1 masked.
# Σ L m = −1.2 − 0.9 + 0.8 = −1.3 over 3 tokens.
LOGPS = [[-1.0, -2.0], [-1.0, -1.5]]
RATIOS = [[1.5, 0.9], [0.5, 1.0]]
ADV = [1.0, -1.0]
MASK = [[1.0, 1.0], [1.0, 0.0]]


def _hand(ratios=RATIOS, adv=ADV, mask=MASK, logps=LOGPS):
    lp = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.log(torch.tensor(ratios, dtype=torch.float64))
    return lp, old, torch.tensor(adv, dtype=torch.float64), torch.tensor(mask, dtype=torch.float64)


def _loss_and_grad(loss_type, **kwargs):
    lp, old, adv, mask = _hand()
    loss, metrics = policy_loss(loss_type, lp, old, adv, mask, **kwargs)
    loss.backward()
    return loss.item(), lp.grad.tolist(), metrics


def test_grpo_by_hand():
    loss, grad, m = _loss_and_grad("grpo")
    # sequence means: row 0 (−1.2 − 0.9)/2 = −1.05, row 1 0.8/1; batch mean −0.125
    assert loss == pytest.approx(-0.125, abs=TOL)
    assert _flat(grad) == pytest.approx(_flat([[0.0, -0.9 / 2 / 2], [0.0, 0.0]]), abs=TOL)
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert m["clip_ratio/region_mean"] == pytest.approx(2 / 3)
    assert m["clip_ratio/low_min"] == 0.0  # row 0 has no low-clipped token
    assert m["clip_ratio/high_max"] == 0.5  # row 0: one of two tokens


def test_grpo_divides_by_accumulation():
    loss, grad, _ = _loss_and_grad("grpo", gradient_accumulation_steps=4)
    assert loss == pytest.approx(-0.125 / 4, abs=TOL)
    assert grad[0][1] == pytest.approx(-0.9 / 4 / 4, abs=TOL)


def test_bnpo_and_dr_grpo_by_hand():
    loss, grad, _ = _loss_and_grad("bnpo", gradient_accumulation_steps=2)
    assert loss == pytest.approx(-1.3 / 3 / 2, abs=TOL)
    assert grad[0][1] == pytest.approx(-0.9 / 3 / 2, abs=TOL)
    loss, grad, _ = _loss_and_grad("dr_grpo", max_completion_length=4)
    assert loss == pytest.approx(-1.3 / (2 * 4), abs=TOL)
    assert grad[0][1] == pytest.approx(-0.9 / 8, abs=TOL)


def test_dapo_by_hand_global_normaliser():
    # N = 12 tokens over P = 2 ranks: each rank divides by 6, and GA does not divide.
    loss, grad, _ = _loss_and_grad("dapo", num_items_in_batch=12, num_processes=2, gradient_accumulation_steps=2)
    assert loss == pytest.approx(-1.3 / 6, abs=TOL)
    assert grad[0][1] == pytest.approx(-0.9 / 6, abs=TOL)


def test_dapo_without_num_items_uses_the_micro_batch_token_count():
    loss, _, _ = _loss_and_grad("dapo")
    assert loss == pytest.approx(-1.3 / 3, abs=TOL)
    bnpo, _, _ = _loss_and_grad("bnpo")
    assert loss == pytest.approx(bnpo, abs=TOL)


def test_luspo_by_hand():
    # TRL 1.16: mean_i Σ_t L m: row sums −2.1 and 0.8 → −0.65
    with pytest.warns(UserWarning, match="luspo"):
        loss, grad, _ = _loss_and_grad("luspo")
    assert loss == pytest.approx(-0.65, abs=TOL)
    assert grad[0][1] == pytest.approx(-0.9 / 2, abs=TOL)


def test_cispo_by_hand():
    # ε_hi = 1.2: detached weights [1.2, 0.9], [0.5, ·]; L = −w·A·ℓ
    #   row 0: −1.2·1·(−1) = 1.2, −0.9·1·(−2) = 1.8; row 1: −0.5·(−1)·(−1) = −0.5 → Σ = 2.5 over N = 3
    loss, grad, m = _loss_and_grad("cispo", epsilon_high=1.2)
    assert loss == pytest.approx(2.5 / 3, abs=TOL)
    assert _flat(grad) == pytest.approx(_flat([[-1.2 / 3, -0.9 / 3], [0.5 / 3, 0.0]]), abs=TOL)
    assert m["cispo_clip_ratio"] == pytest.approx(1 / 3)  # row 0, t0: 1.5 > 1.2 and A > 0
    assert "clip_ratio/region_mean" not in m


def test_cispo_default_cap_is_5():
    """ε_hi defaults to 5.0 (ScaleRL, as TRL's docs state), not to epsilon as in TRL 1.16's code."""
    assert CISPOLoss().epsilon_high_value == 5.0 and CISPOLoss(epsilon=0.1).epsilon_high_value == 5.0
    assert CISPOLoss().epsilon_high is None  # the setting stays unset; only its meaning is per class
    assert GRPOLoss(epsilon=0.1).epsilon_high_value == 0.1  # the clipped family keeps ε_hi = ε
    for kwargs in ({}, {"epsilon": 0.1}, {"epsilon_high": None}):
        loss, grad, m = _loss_and_grad("cispo", **kwargs)
        # no ratio reaches 5: row 0: −1.5·1·(−1) − 0.9·1·(−2) = 3.3; row 1: −0.5·(−1)·(−1) = −0.5
        assert loss == pytest.approx(2.8 / 3, abs=TOL)
        assert _flat(grad) == pytest.approx(_flat([[-1.5 / 3, -0.9 / 3], [0.5 / 3, 0.0]]), abs=TOL)
        assert m["cispo_clip_ratio"] == 0.0


def test_cispo_explicit_cap_of_trl_code_default():
    loss, _, m = _loss_and_grad("cispo", epsilon_high=0.2)
    # weights capped at 0.2: row 0: 0.2·1 + 0.2·2 = 0.6; row 1: −0.2 → Σ 0.4 / 3
    assert loss == pytest.approx(0.4 / 3, abs=TOL)
    assert m["cispo_clip_ratio"] == pytest.approx(2 / 3)  # row 0: both ratios exceed 0.2 with A > 0


def test_sequence_level_by_hand():
    # row 0: c1 = exp(mean(log 1.5, log 0.9)) = sqrt(1.35) inside [0.8, 1.2] → L = −c1 on both tokens;
    # row 1: c1 = 0.5 (only its one real token), clipped to 0.8 → L = 0.8, no grad.
    c = math.sqrt(1.35)
    loss, grad, m = _loss_and_grad("grpo", importance_sampling_level="sequence")
    assert loss == pytest.approx((-c + 0.8) / 2, abs=TOL)
    # d(−c1)/dℓ_t = −c1/2 per token of row 0, times the batch mean 1/2
    assert _flat(grad) == pytest.approx(_flat([[-c / 4, -c / 4], [0.0, 0.0]]), abs=TOL)
    # sequence-level metrics average over sequences: row 1 is low-clipped
    assert m["clip_ratio/low_mean"] == pytest.approx(0.5)
    assert m["clip_ratio/high_mean"] == 0.0


def test_delta_caps_the_unclipped_ratio_by_hand():
    # One row, A = −1, ratios [2.0, 1.0]: without delta L = [2, 1]; with delta = 1.5, L = [1.5, 1].
    lp, old, adv, mask = _hand(ratios=[[2.0, 1.0]], adv=[-1.0], mask=[[1.0, 1.0]], logps=[[-1.0, -1.0]])
    loss, _ = policy_loss("grpo", lp, old, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(1.5, abs=TOL)
    assert _flat(lp.grad.tolist()) == pytest.approx(_flat([[1.0, 0.5]]), abs=TOL)
    lp.grad = None
    loss, m = policy_loss("grpo", lp, old, adv, mask, delta=1.5)
    loss.backward()
    assert loss.item() == pytest.approx(1.25, abs=TOL)
    assert _flat(lp.grad.tolist()) == pytest.approx(_flat([[0.0, 0.5]]), abs=TOL)


def test_delta_clip_metrics_use_the_capped_ratio():
    lp, old, adv, mask = _hand(ratios=[[2.0, 1.0]], adv=[1.0], mask=[[1.0, 1.0]], logps=[[-1.0, -1.0]])
    _, m = policy_loss("dapo", lp, old, adv, mask)
    assert m["clip_ratio/high_mean"] == 0.5
    _, m = policy_loss("dapo", lp, old, adv, mask, delta=1.1)
    assert m["clip_ratio/high_mean"] == 0.0  # 2.0 capped at 1.1 < 1.2


@pytest.mark.parametrize(("kl", "kept"), [(0.5, False), (0.05, True)])
def test_off_policy_mask_by_hand(kl, kept):
    lp, old, adv, mask = _hand()
    samp = lp.detach() + kl  # mean (ℓ_s − ℓ) over the row = kl
    samp[0] += 10.0  # A ≥ 0 rows are always kept
    loss, _ = policy_loss("grpo", lp, old, adv, mask, off_policy_mask_threshold=0.1, sampling_logps=samp)
    assert loss.item() == pytest.approx(-0.125 if kept else -1.05 / 2, abs=TOL)


def test_off_policy_mask_without_sampling_logps_uses_old_logps():
    lp, old, adv, mask = _hand()
    # row 1's mean (ℓ_old − ℓ) over its one real token is −log 0.5 ≈ 0.69 > 0.1 → dropped
    loss, _ = policy_loss("grpo", lp, old, adv, mask, off_policy_mask_threshold=0.1)
    assert loss.item() == pytest.approx(-1.05 / 2, abs=TOL)
    # on-policy (old = ℓ.detach()) the KL is 0 and nothing is dropped
    loss, _ = policy_loss("grpo", lp, None, adv, mask, off_policy_mask_threshold=0.1)
    assert loss.item() == pytest.approx((-2.0 / 2 + 1.0) / 2, abs=TOL)


@pytest.mark.parametrize(("bias_correction", "grad0"), [(False, -0.25), (True, (-1 + (1 - math.log(2))) / 4)])
def test_kl_by_hand(bias_correction, grad0):
    # On-policy, A = 0: the loss is β·mean KL. ref − ℓ = [log 2, 0] → k3 = [1 − log 2, 0].
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = lp.detach() + torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)
    loss, m = policy_loss(
        "grpo", lp, None, torch.zeros(1, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
        beta=0.5, ref_logps=ref, use_bias_correction_kl=bias_correction,
    )
    loss.backward()
    k3 = 1 - math.log(2.0)
    assert loss.item() == pytest.approx(0.5 * k3 / 2, abs=TOL)
    assert m["kl"] == pytest.approx(k3 / 2, abs=TOL)
    # dk3/dℓ = 1 − exp(ref − ℓ) = −1; with bias correction d(k3·c1)/dℓ = −1 + k3 (c1 = 1, dc1/dℓ = 1)
    assert lp.grad[0, 0].item() == pytest.approx(grad0, abs=TOL)


def test_kl_is_not_masked_by_opsm_nor_is_weights():
    lp, old, adv, mask = _hand()
    ref = lp.detach() + 0.3
    kwargs = dict(beta=0.1, ref_logps=ref, use_bias_correction_kl=False)
    base, _ = policy_loss("bnpo", lp, old, torch.zeros(2, dtype=torch.float64), mask, **kwargs)
    zero_is = torch.zeros(2, 2, dtype=torch.float64)
    weighted, _ = policy_loss("bnpo", lp, old, adv, mask, sampling_is_weights=zero_is, **kwargs)
    assert weighted.item() == pytest.approx(base.item(), abs=TOL)  # IS weight 0 kills only the policy term


def test_is_weights_multiply_the_policy_term():
    lp, old, adv, mask = _hand()
    isw = torch.tensor([[2.0, 1.0], [0.5, 7.0]], dtype=torch.float64)
    loss, _ = policy_loss("bnpo", lp, old, adv, mask, sampling_is_weights=isw)
    assert loss.item() == pytest.approx((-1.2 * 2 - 0.9 + 0.8 * 0.5) / 3, abs=TOL)
    seq = torch.tensor([[2.0], [0.5]], dtype=torch.float64)  # (B, 1) sequence-level weights broadcast
    loss, _ = policy_loss("bnpo", lp, old, adv, mask, sampling_is_weights=seq)
    assert loss.item() == pytest.approx((-2.1 * 2 + 0.8 * 0.5) / 3, abs=TOL)


def test_entropy_bonus_is_the_token_mean_for_every_loss_type():
    lp, old, adv, mask = _hand()
    ent = torch.tensor([[2.0, 4.0], [3.0, 100.0]], dtype=torch.float64)  # masked 100 ignored
    for loss_type in LOSSES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kwargs = dict(max_completion_length=4, gradient_accumulation_steps=2, entropies=ent)
            plain, _ = policy_loss(loss_type, lp, old, adv, mask, **kwargs)
            bonus, m = policy_loss(loss_type, lp, old, adv, mask, entropy_coef=0.1, **kwargs)
        assert bonus.item() == pytest.approx(plain.item() - 0.1 * 3.0 / 2, abs=TOL), loss_type
        assert m["entropy"] == pytest.approx(3.0)
        # policy_loss metric: before the GA division for the grpo-like families, as returned for dapo-like
        scale = 1 if loss_type in ("dapo", "cispo", "vespo") else 2
        assert m["policy_loss"] == pytest.approx(plain.item() * scale, abs=TOL), loss_type
    _, m = policy_loss("grpo", lp, old, adv, mask, entropies=ent)
    assert "policy_loss" not in m


def test_entropy_mask_masks_the_policy_term_and_the_bonus_but_not_the_kl_nor_the_normaliser():
    lp, old, adv, mask = _hand()
    ent = torch.tensor([[2.0, 4.0], [3.0, 100.0]], dtype=torch.float64)
    keep = torch.tensor([[False, True], [True, False]])  # drops row 0, t0 (the clipped −1.2)
    ref = lp.detach() + 0.3
    k3 = math.exp(0.3) - 0.3 - 1
    inputs = dict(old_logps=old, advantages=adv, mask=mask, entropies=ent, gradient_accumulation_steps=1)
    out = BNPOLoss(beta=0.1, use_bias_correction_kl=False)(
        LossInputs(lp, ref_logps=ref, entropy_coef=0.1, entropy_mask=keep, **inputs)
    )
    # policy: (−0.9 + 0.8) over all 3 tokens (normaliser unchanged); KL on all 3 tokens;
    # bonus: mean entropy over the kept tokens (4 + 3) / 2
    expected = (-0.9 + 0.8) / 3 + 0.1 * k3 - 0.1 * 3.5
    assert out.loss.item() == pytest.approx(expected, abs=TOL)
    assert out.metrics["entropy"].local() == pytest.approx(3.0)  # the metric is not restricted


def test_top_entropy_mask():
    h = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.3, 9.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert top_entropy_mask(h, m, 1.0).tolist() == m.bool().tolist()
    assert top_entropy_mask(h, m, 0.0).int().tolist() == [[0, 1, 0], [0, 0, 0]]  # the max only
    assert not top_entropy_mask(h, torch.zeros_like(m), 0.5).any()
    # the threshold comes from the gathered (all-rank) entropies when given
    assert not top_entropy_mask(h, m, 0.5, gathered=torch.tensor([10.0, 20.0])).any()
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        top_entropy_mask(h, m, 1.5)


def test_sapo_on_policy_is_the_plain_policy_gradient():
    # c1 = 1: gate σ(0)·4/τ = 2/τ, and its slope is 1, so dL/dℓ = −A (times the normaliser).
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    loss, _ = policy_loss("sapo", lp, None, adv, mask, sapo_temperature_pos=1.0, sapo_temperature_neg=2.0)
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 * 1 / 1 + -(2.0 / 2.0) * -2.0) / 2, abs=TOL)
    assert _flat(lp.grad.tolist()) == pytest.approx(_flat([[-0.25, -0.25], [0.5, 0.5]]), abs=TOL)


def test_vespo_on_policy_weight_is_one():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    loss, m = policy_loss("vespo", lp, None, adv, mask)
    loss.backward()
    # L = −φ·A·ℓ with φ = 1: row 0: −3 (1·(−1) + 1·(−2) → 3 with the minus), row 1: −(−2)(−0.5) = −1
    assert loss.item() == pytest.approx((-(1 * -1.0) - (1 * -2.0) - (-2.0 * -0.5)) / 3, abs=TOL)
    assert _flat(lp.grad.tolist()) == pytest.approx(_flat([[-1 / 3, -1 / 3], [2 / 3, 0.0]]), abs=TOL)
    assert m["vespo/phi_seq_mean"] == pytest.approx(1.0)


def test_vespo_weight_by_hand():
    # one row, Σ log-ratio = log 2 → w = 2, A ≥ 0: φ = e^3 · 2^2 · e^{−6} = 4 e^{−3}
    lp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)
    _, m = policy_loss("vespo", lp, old, torch.tensor([0.0], dtype=torch.float64), torch.ones(1, 2))
    assert m["vespo/phi_seq_mean"] == pytest.approx(4 * math.exp(-3), abs=TOL)
    # a sampler weight ρ = 1/2 on the same row brings w back to 1 → φ = 1
    isw = torch.tensor([[0.5, 1.0]], dtype=torch.float64)
    _, m = policy_loss("vespo", lp, old, torch.tensor([0.0], dtype=torch.float64), torch.ones(1, 2),
                       sampling_is_weights=isw)
    assert m["vespo/phi_seq_mean"] == pytest.approx(1.0, abs=TOL)


# ---- gradient checks -----------------------------------------------------------------------------
# cispo and vespo detach their weights on purpose (stop-gradient), so a finite-difference check does
# not apply to them; their analytic gradients are pinned by hand above and below.
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradcheck(loss_type, level):
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(3, 4, generator=g, dtype=torch.float64) * 2 - 0.1).requires_grad_(True)
    old = lp.detach() + (torch.rand(3, 4, generator=g, dtype=torch.float64) - 0.5) * 0.3
    ref = lp.detach() + (torch.rand(3, 4, generator=g, dtype=torch.float64) - 0.5) * 0.3
    adv = torch.tensor([0.7, -1.1, 0.4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)

    def fn(x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return policy_loss(loss_type, x, old, adv, mask, beta=0.1, ref_logps=ref, epsilon=0.05,
                               importance_sampling_level=level, max_completion_length=4)[0]

    assert torch.autograd.gradcheck(fn, (lp,), eps=1e-7, atol=1e-6)


def test_vespo_gradient_is_the_detached_weight_times_the_advantage():
    lp, old, adv, mask = _hand()
    loss, m = policy_loss("vespo", lp, old, adv, mask, num_items_in_batch=3)
    loss.backward()
    # log w = Σ masked log-ratios: row 0 log 1.35 (A ≥ 0: k=2, λ=3), row 1 log 0.5 (A < 0: k=3, λ=2)
    phi = [math.exp(3 + 2 * math.log(1.35) - 3 * 1.35), math.exp(2 + 3 * math.log(0.5) - 2 * 0.5)]
    expected = [[-phi[0] / 3, -phi[0] / 3], [phi[1] / 3, 0.0]]
    assert _flat(lp.grad.tolist()) == pytest.approx(_flat(expected), abs=TOL)
    assert m["vespo/phi_seq_mean"] == pytest.approx(sum(phi) / 2, abs=TOL)


# ---- distributed / accumulation invariants -------------------------------------------------------
def _random_batch(seed, B=4, T=5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = lp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.6
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    return lp, old, adv, mask


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_global_token_normaliser_is_split_invariant(loss_type):
    lp, old, adv, mask = _random_batch(0)
    n = mask.sum()
    full = lp.clone().requires_grad_(True)
    policy_loss(loss_type, full, old, adv, mask, num_items_in_batch=n)[0].backward()
    # two ranks x two accumulation steps: DDP averages rank gradients, accumulation sums micro-steps
    total = torch.zeros_like(lp)
    for rank in range(2):
        for step in range(2):
            rows = slice(2 * rank + step, 2 * rank + step + 1)
            part = lp[rows].clone().requires_grad_(True)
            loss, _ = policy_loss(loss_type, part, old[rows], adv[rows], mask[rows], num_items_in_batch=n,
                                  num_processes=2, gradient_accumulation_steps=2)
            loss.backward()
            total[rows] += part.grad / 2
    assert torch.allclose(total, full.grad, atol=1e-12)


# ---- edge cases ----------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_fully_masked_batch_gives_zero_loss_and_finite_grads(loss_type):
    lp = torch.randn(2, 3, dtype=torch.float64).requires_grad_(True)
    old = lp.detach() + 0.1
    mask = torch.zeros(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, m = policy_loss(loss_type, lp, old, torch.tensor([1.0, -1.0]), mask, max_completion_length=3,
                              entropies=torch.ones(2, 3), entropy_coef=0.1)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(lp.grad).all()
    if "clip_ratio/low_min" in m:
        assert math.isnan(m["clip_ratio/low_min"])  # no sequence to take a min over


@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_token_metrics_of_a_width_one_micro_batch_count_only_its_loss_tokens(loss_type):
    """A micro-batch trimmed to completion width 1 has ``(B, 1)`` token tensors: its token metrics
    are still masked means (rows 1 and 2 are masked out: no loss tokens), not means over rows."""
    lp = torch.log(torch.tensor([[0.5], [0.5], [0.5]], dtype=torch.float64)).requires_grad_(True)
    old = lp.detach() - torch.tensor([[0.0], [1.0], [1.0]], dtype=torch.float64)  # rows 1, 2: ratio e
    mask = torch.tensor([[1.0], [0.0], [0.0]])
    ref = lp.detach() + torch.tensor([[0.0], [0.5], [0.5]], dtype=torch.float64)  # kl 0 on row 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, m = policy_loss(loss_type, lp, old, torch.tensor([1.0, 1.0, 1.0]), mask, ref_logps=ref, beta=0.1,
                           entropies=torch.tensor([[2.0], [5.0], [5.0]]), max_completion_length=1)
    assert m["entropy"] == pytest.approx(2.0)
    assert m["kl"] == pytest.approx(0.0, abs=TOL)
    for name in ("clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/high_max", "cispo_clip_ratio"):
        if name in m:
            assert m[name] == 0.0, name  # the high-clipped rows 1, 2 carry no loss token


def test_sequence_level_metrics_of_a_width_one_micro_batch_average_over_rows():
    """At sequence level a ``(B, 1)`` ratio is one value per sequence, averaged over all rows as in
    TRL, whatever the completion width: row 1 (no loss token, ratio 1) counts, so the high-clipped
    row 0 is half the rows (a masked token mean would say 1.0)."""
    lp = torch.log(torch.tensor([[0.5], [0.5]], dtype=torch.float64)).requires_grad_(True)
    old = lp.detach() - torch.tensor([[1.0], [0.0]], dtype=torch.float64)  # row 0: ratio e
    _, m = policy_loss("grpo", lp, old, torch.tensor([1.0, 1.0]), torch.tensor([[1.0], [0.0]]),
                       importance_sampling_level="sequence")
    assert m["clip_ratio/high_mean"] == pytest.approx(0.5)


def test_mask_dtypes_are_accepted():
    lp, old, adv, mask = _hand()
    ref, _ = policy_loss("grpo", lp, old, adv, mask)
    for m in (mask.bool(), mask.long(), mask.float()):
        loss, _ = policy_loss("grpo", lp, old, adv, m)
        assert loss.item() == pytest.approx(ref.item(), abs=TOL)


def test_advantages_may_be_per_token():
    lp, old, adv, mask = _hand()
    a, _ = policy_loss("bnpo", lp, old, adv, mask)
    b, _ = policy_loss("bnpo", lp, old, adv[:, None].expand(2, 2), mask)
    assert a.item() == pytest.approx(b.item(), abs=TOL)


def test_on_policy_ratio_is_one_and_has_gradient():
    lp, _, adv, mask = _hand()
    loss, m = policy_loss("grpo", lp, None, adv, mask)
    loss.backward()
    assert m["clip_ratio/region_mean"] == 0.0
    assert lp.grad.abs().sum() > 0


# ---- the class API, the registry and metric records -------------------------------------------
def test_registry_names_and_classes():
    assert list(LOSSES) == ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
    expected = {
        "grpo": GRPOLoss, "dr_grpo": DrGRPOLoss, "dapo": DAPOLoss, "bnpo": BNPOLoss,
        "cispo": CISPOLoss, "sapo": SAPOLoss, "luspo": LUSPOLoss, "vespo": VESPOLoss,
    }
    assert LOSSES == expected
    for name, cls in LOSSES.items():
        assert cls.name == name
        assert issubclass(cls, PolicyLoss)


def test_defaults_match_trl():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = {name: cls() for name, cls in LOSSES.items()}
    for loss in losses.values():
        assert (loss.epsilon, loss.epsilon_high, loss.delta, loss.beta) == (0.2, None, None, 0.0)
        assert loss.importance_sampling_level == "token"
        assert loss.use_bias_correction_kl is True
        assert loss.off_policy_mask_threshold is None
    assert (losses["sapo"].sapo_temperature_pos, losses["sapo"].sapo_temperature_neg) == (1.0, 1.05)
    v = losses["vespo"]
    assert (v.vespo_k_pos, v.vespo_lambda_pos, v.vespo_k_neg, v.vespo_lambda_neg) == (2.0, 3.0, 3.0, 2.0)
    assert losses["dr_grpo"].max_completion_length is None


def test_get_loss_resolution():
    assert isinstance(get_loss("dapo"), DAPOLoss)
    assert get_loss("grpo", beta=0.04).beta == 0.04
    assert isinstance(get_loss(CISPOLoss, epsilon_high=5.0), CISPOLoss)
    inst = BNPOLoss()
    assert get_loss(inst) is inst
    with pytest.raises(ValueError, match="instance"):
        get_loss(inst, beta=1.0)
    with pytest.raises(ValueError, match=r"model\.loss='ppo': unknown loss.*grpo.*vespo.*class_path"):
        get_loss("ppo")
    with pytest.raises(TypeError):
        get_loss(3)
    with pytest.raises(ValueError, match="Valid names"):
        policy_loss("nope", *_hand())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(importance_sampling_level="seq"), "importance_sampling_level"),
        (dict(epsilon=-0.1), "epsilon"),
        (dict(epsilon_high=-1.0), "epsilon_high"),
        (dict(delta=1.0), "delta"),
        (dict(delta=0.5), "delta"),
        (dict(beta=-0.1), "beta"),
        (dict(beta=float("nan")), "beta"),
        (dict(off_policy_mask_threshold="x"), "off_policy_mask_threshold"),
    ],
)
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOLoss(**kwargs)


def test_subclass_validation():
    with pytest.raises(ValueError, match="sapo_temperature_neg"):
        SAPOLoss(sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match="vespo_lambda_pos"):
        VESPOLoss(vespo_lambda_pos=-1.0)
    with pytest.raises(ValueError, match="max_completion_length"):
        DrGRPOLoss(max_completion_length=0)


def test_runtime_errors_name_the_missing_input():
    lp, old, adv, mask = _hand()
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss("dr_grpo", lp, old, adv, mask)
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss("grpo", lp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="entropies"):
        policy_loss("grpo", lp, old, adv, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match="shape"):
        policy_loss("grpo", lp, old, adv, mask[:, :1])


def test_dr_grpo_constructor_length_wins_over_the_call():
    lp, old, adv, mask = _hand()
    out = DrGRPOLoss(max_completion_length=4)(LossInputs(lp, old, adv, mask, max_completion_length=100))
    assert out.loss.item() == pytest.approx(-1.3 / 8, abs=TOL)


@pytest.mark.parametrize(
    ("loss_type", "level", "match"),
    [("luspo", "token", "luspo"), ("vespo", "sequence", "VESPO"), ("dapo", "sequence", "dapo"),
     ("bnpo", "sequence", "bnpo"), ("dr_grpo", "sequence", "dr_grpo"), ("cispo", "sequence", "cispo")],
)
def test_trl_warnings(loss_type, level, match):
    with pytest.warns(UserWarning, match=match):
        LOSSES[loss_type](importance_sampling_level=level)


@pytest.mark.parametrize(("loss_type", "level"), [("grpo", "sequence"), ("luspo", "sequence"), ("dapo", "token")])
def test_no_warning_for_recommended_settings(loss_type, level):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LOSSES[loss_type](importance_sampling_level=level)


def test_class_call_returns_metric_records_with_exact_sums():
    lp, old, adv, mask = _hand()
    out = GRPOLoss()(LossInputs(lp, old, adv, mask, entropies=torch.ones(2, 2)))
    assert isinstance(out, LossOutput)
    low = out.metrics["clip_ratio/low_mean"]
    assert isinstance(low, MetricValue) and low.reduce == "mean"
    assert (low.total.item(), low.count.item()) == (1.0, 3.0)
    assert out.metrics["clip_ratio/low_min"].reduce == "min"
    assert out.metrics["clip_ratio/high_max"].reduce == "max"
    assert not any(v.total.requires_grad for v in out.metrics.values())
    # the functional entry point reports the same local values
    _, metrics = policy_loss("grpo", lp, old, adv, mask, entropies=torch.ones(2, 2))
    assert metrics == {k: v.local() for k, v in out.metrics.items()}


def test_metric_names_per_loss_type():
    lp, old, adv, mask = _hand()
    ref = lp.detach()
    names = {}
    for loss_type in LOSSES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, m = policy_loss(loss_type, lp, old, adv, mask, beta=0.1, ref_logps=ref, max_completion_length=2)
        names[loss_type] = set(m)
    clip = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
            "clip_ratio/high_max"}
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        assert names[lt] == clip | {"kl"}
    assert names["cispo"] == {"cispo_clip_ratio", "kl"}
    assert names["sapo"] == {"kl"}
    assert names["vespo"] == {"vespo/phi_seq_mean", "kl"}


def test_beta_is_public_for_the_reference_model_decision():
    assert GRPOLoss().beta == 0.0
    assert GRPOLoss(beta=0.04).beta == 0.04


def test_repr_lists_the_knobs():
    assert "epsilon=0.2" in repr(DAPOLoss())

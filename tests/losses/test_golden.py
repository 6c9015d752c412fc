"""Spec §13.1 golden numbers: every row, loss, gradient row sums and the listed metrics.

The golden numbers are TRL's float32 results printed to 6 decimals: ours match them to half a unit
of the 6th decimal plus the float32 rounding of both runs (``tests/numerics.py``), 1e-6 to 1e-5 here
(the spec states them "to 1e-5").

The golden rows were produced by TRL with ``use_bias_correction_kl=False`` (its default at the
studied commit) except the row marked bias-corrected, so that setting is passed explicitly. The
entropy-bonus rows use the TRL 1.16 per-token-mean bonus (``policy_loss − 0.1·1.248229/2``).
The cispo row used TRL 1.16's code default ``ε_hi = ε = 0.2``, passed explicitly (ours is 5.0).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from grpo_lightning.losses import policy_loss
from tests.losses.magnitudes import term_magnitude
from tests.numerics import f32_tolerance

PRINTED = 5e-7  # half a unit of the 6th decimal
TOKENS = 20  # the 4x5 batch


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    new = -torch.rand(4, 5, generator=g) * 2 - 0.1
    old = new + (torch.rand(4, 5, generator=g) - 0.5) * 0.8
    ref = new + (torch.rand(4, 5, generator=g) - 0.5) * 0.6
    samp = old + (torch.rand(4, 5, generator=g) - 0.5) * 0.4
    ent = torch.rand(4, 5, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]).float()
    adv = torch.tensor([1.0, -0.5, 0.8, -1.3])
    isr_token = torch.exp((old - samp) * mask).clamp(max=3.0)
    return dict(new=new, old=old, ref=ref, samp=samp, ent=ent, mask=mask, adv=adv, isr=isr_token)


CLIP_METRICS = {
    "clip_ratio/low_mean": 0.076923,
    "clip_ratio/high_mean": 0.153846,
    "clip_ratio/region_mean": 0.230769,
    "clip_ratio/high_max": 0.25,
}

# (id, loss_type, extra kwargs (tensor names as strings), loss, grad row sums, metrics)
ROWS = [
    ("grpo", "grpo", {}, 0.018409, [-0.113876, 0.037201, -0.058662, 0.19708], CLIP_METRICS),
    ("bnpo", "bnpo", {}, -0.220107, [-0.175194, 0.034339, -0.0722, 0.06064], {}),
    ("dr_grpo", "dr_grpo", {}, -0.143069, [-0.113876, 0.02232, -0.04693, 0.039416], {}),
    ("dapo", "dapo", {}, -0.220107, [-0.175194, 0.034339, -0.0722, 0.06064], {"entropy": 1.248229}),
    ("cispo", "cispo", {"epsilon_high": 0.2}, 0.040426, [-0.038462, 0.011538, -0.024615, 0.01],
     {"cispo_clip_ratio": 0.692308}),
    ("sapo", "sapo", {}, -0.011057, [-0.144508, 0.053235, -0.092232, 0.194641], {}),
    ("vespo", "vespo", {}, 0.103085, [-0.029129, 0.029557, -0.14866, 0.058278], {"vespo/phi_seq_mean": 0.759302}),
    ("luspo-seq", "luspo", {"importance_sampling_level": "sequence"}, -0.733006,
     [-0.727354, 0.160042, -0.362774, 0.19708], {}),
    ("gspo", "grpo", {"importance_sampling_level": "sequence"}, 0.014263,
     [-0.145471, 0.053347, -0.090694, 0.19708], {}),
    ("dapo-eps-high", "dapo", {"epsilon_high": 0.28}, -0.225386, [-0.224166, 0.034339, -0.0722, 0.06064], {}),
    ("dapo-delta", "dapo", {"delta": 1.1}, -0.206682, [-0.041129, 0.034339, -0.0722, 0.0],
     {"clip_ratio/high_mean": 0.0}),
    ("cispo-eps-high", "cispo", {"epsilon_high": 1.1}, 0.20128, [-0.210359, 0.04949, -0.106046, 0.055],
     {"cispo_clip_ratio": 0.384615}),
    ("dapo-beta", "dapo", {"beta": 0.1, "ref_logps": "ref"}, -0.219265,
     [-0.176474, 0.033909, -0.071133, 0.059594], {"kl": 0.016845}),
    ("dapo-beta-biascorr", "dapo", {"beta": 0.1, "ref_logps": "ref", "use_bias_correction_kl": True}, -0.219237,
     [-0.176137, 0.033967, -0.070908, 0.059518], {"kl": 0.017401}),
    ("dapo-opsm", "dapo", {"off_policy_mask_threshold": 0.1, "sampling_logps": "samp"}, -0.26983,
     [-0.175194, 0.0, -0.0722, 0.06064], {}),
    ("dapo-is", "dapo", {"sampling_is_weights": "isr"}, -0.211621, [-0.174411, 0.034525, -0.068174, 0.058031], {}),
    ("vespo-is", "vespo", {"sampling_is_weights": "isr"}, 0.130268, [-0.0598, 0.029952, -0.145283, 0.056693], {}),
    ("dapo-entropy", "dapo", {"entropy_coef": 0.1}, -0.282518, [-0.175194, 0.034339, -0.0722, 0.06064],
     {"policy_loss": -0.220107}),
    ("grpo-entropy", "grpo", {"entropy_coef": 0.1}, -0.044002, [-0.113876, 0.037201, -0.058662, 0.19708],
     {"policy_loss": 0.036818}),
]


def _tol(scale: float) -> float:
    """Printing plus the float32 rounding of TRL's run and ours, summing the batch's tokens."""
    return PRINTED + f32_tolerance(reduction_size=TOKENS, scale=scale, sides=2)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_golden_row(row):
    _, loss_type, extra, expected_loss, expected_grad, expected_metrics = row
    t = _tensors()
    kwargs = {"use_bias_correction_kl": False, "entropies": t["ent"]}
    kwargs.update({k: (t[v] if isinstance(v, str) and v in t else v) for k, v in extra.items()})
    fixed = dict(num_items_in_batch=26, num_processes=1, gradient_accumulation_steps=2, max_completion_length=5)
    new = t["new"].clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, metrics = policy_loss(loss_type, new, t["old"], t["adv"], t["mask"], **fixed, **kwargs)

        def compute(adv, ent, ref):  # the same row in float64, for the magnitude of its terms
            k64 = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            k64["entropies"] = ent
            if "ref_logps" in k64:
                k64["ref_logps"] = ref
            return policy_loss(loss_type, t["new"].double(), t["old"].double(), adv, t["mask"], **fixed, **k64)[0]

        terms = term_magnitude(compute, t["new"], t["adv"], t["ent"], t["ref"])
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, abs=_tol(terms))
    # a row sum of 5 per-token gradients
    grad_scale = float(new.grad.abs().sum(1).max())
    assert new.grad.sum(1).tolist() == pytest.approx(expected_grad, abs=_tol(grad_scale))
    for name, value in expected_metrics.items():
        # token means, fractions and extremes of O(1) values; or the policy loss
        assert metrics[name] == pytest.approx(value, abs=_tol(max(1.0, abs(value), terms))), name


def test_golden_entropy_metric_is_the_masked_token_mean():
    t = _tensors()
    _, metrics = policy_loss("grpo", t["new"], t["old"], t["adv"], t["mask"], entropies=t["ent"])
    assert metrics["entropy"] == pytest.approx(1.248229, abs=_tol(float(t["ent"].max())))
    assert metrics["clip_ratio/low_min"] == 0.0

"""Two float32 runs of the same SGD step agree to rounding error (``tests/numerics.py``)."""

from __future__ import annotations

import math

import torch

from tests.module.test_forward_paths import reduction_size
from tests.numerics import assert_close_f32


def logit_bound(model: torch.nn.Module, temperature: float = 1.0) -> float:
    """A bound on ``|logit / temperature|`` from the weights alone: the final RMSNorm's output is
    ``γ ⊙ n`` with ``‖n‖ = sqrt(hidden)``, so ``|W_v · (γ ⊙ n)| ≤ ‖W_v‖ · max|γ| · sqrt(hidden)``."""
    head = model.get_output_embeddings().weight.detach().double()
    gamma = model.model.norm.weight.detach().double().abs().max()
    hidden = head.shape[1]
    return float(head.norm(dim=1).max() * gamma * math.sqrt(hidden)) / temperature


def assert_same_sgd_step(got, want, initial, model, *, width: int, tokens: int, temperature: float = 1.0, names=None):
    """``got`` and ``want`` (parameters after one SGD step with ``lr = 1`` from ``initial``) agree.

    The step is ``w − g``: the gradient ``g = initial − want`` carries the float32 error of a
    forward and a backward through ``model`` (twice the forward's reductions for rows ``width``
    tokens wide, plus the sum over the step's ``tokens``), relative to the logits' magnitude
    (:func:`logit_bound`, plus 1 for the normed hidden states) times the gradient's; ``w − g``
    then rounds once at the weight's magnitude. Both runs carry these errors. ``names`` label the
    parameters in a failure (default: their index).
    """
    size = 2 * reduction_size(model, width) + tokens
    logit_scale = logit_bound(model, temperature) + 1.0
    names = names or [f"parameter {i}" for i in range(len(want))]
    for name, a, b, w in zip(names, got, want, initial):
        gradient = logit_scale * float((w - b).abs().max())
        weight = float(w.abs().max()) / math.sqrt(size)  # one rounding, written on the sqrt(size) scale
        assert_close_f32(a, b, reduction_size=size, scale=gradient + weight, msg=name)

"""Tolerances for floating-point comparisons, derived from rounding error instead of tuned to one CPU.

Why not ``atol=1e-5``: PyTorch picks CPU kernels at run time (AVX-512, AVX2, or the scalar
``default`` path; ``ATEN_CPU_CAPABILITY`` forces one) and other machines have other BLAS builds.
They add in different orders and fuse multiply-adds differently, so two correct float32 results
differ by rounding error, whose size depends on the computation (how many terms are summed, how
large they are), not on the machine. A fixed number that passed on one CPU fails on the next
(issue #8: 1.17e-5 against ``atol=1e-5`` on an AVX2 EPYC).

The model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1 and §4.2, and
the probabilistic bound of Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019):

* every float operation rounds with relative error at most ``u = eps/2``
  (``eps = torch.finfo(dtype).eps``: 1.19e-7 for float32, 7.8e-3 for bfloat16);
* a sum or dot product of ``n`` terms rounds ``n`` times; the worst case is ``n·u·Σ|terms|``, but
  the rounding errors are independent and of either sign, so in practice they add like a random
  walk: ``≈ sqrt(n)·u·Σ|terms|``, which ``sqrt(n)·eps·scale`` bounds with ``scale`` the largest
  magnitude the rounded values reach;
* errors of successive stages add, so ``reduction_size`` is the sum of the lengths of the
  reductions on the path from inputs to the compared value (a linear head then a log-softmax:
  ``hidden + vocab``);
* ``scale`` is the magnitude of what is rounded, which may exceed the result: a log-prob
  ``z_y − logsumexp(z)`` carries errors relative to the logits ``|z|``, not to ``|log p|``; and
  ``exp`` turns an absolute error ``eps·|z|`` of a logit into a relative one of the probability,
  so a gradient through a softmax has ``scale = max|z| · max|gradient|``.

``tolerance = SAFETY · sqrt(reduction_size) · eps · scale``; ``SAFETY = 8`` covers the tail of the
random walk over many compared elements and the spread between kernels (the largest error seen
on AVX-512, AVX2 and ``default`` kernels was about one ``sqrt(n)·eps·scale``). When the expected
side is also float32 (two float32 paths, no float64 reference) both sides carry that error and the
tolerance doubles; against a float64 reference (``.double()`` the model and inputs) or an exact
hand-computed value only the tested side does.

What a tolerance of this size still catches: a wrong formula (a missing normaliser, a dropped or
shifted token, the wrong temperature) moves values by ``1e-2`` of their scale or more, while these
tolerances are ``1e-6``-``1e-4`` of it for the sizes in this suite.

Set ``GRPO_NUMERICS_LOG=<file>`` to append, for each comparison, the test, its message, the largest
error, the tolerance and their ratio (how much margin a machine leaves).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

EPS32 = torch.finfo(torch.float32).eps
SAFETY = 8.0

Values = torch.Tensor | float | Sequence[float] | Sequence[Sequence[float]]


def f32_tolerance(
    *,
    reduction_size: int,
    scale: float,
    dtype: torch.dtype = torch.float32,
    sides: int = 1,
    safety: float = SAFETY,
) -> float:
    """``safety · sides · sqrt(reduction_size) · eps(dtype) · scale``: the rounding error of a
    computation in ``dtype`` (see the module docstring for the derivation).

    Args:
        reduction_size: Total length of the reductions on the path to the value (1 for an
            element-wise result that is rounded once).
        scale: Magnitude of the values that are rounded along the path.
        dtype: The working precision (float32, or bfloat16 for what runs under autocast).
        sides: 1 against a float64 or exact reference, 2 when both sides were computed in ``dtype``.
        safety: Headroom over the random-walk estimate.

    >>> f"{f32_tolerance(reduction_size=100, scale=1.0):.2e}"
    '9.54e-06'
    """
    eps = torch.finfo(dtype).eps
    return safety * sides * math.sqrt(max(int(reduction_size), 1)) * eps * float(scale)


def _as_double(x: Values) -> torch.Tensor:
    return x.detach().double().cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)


def assert_close_f32(
    actual: Values,
    expected: Values,
    *,
    reduction_size: int = 1,
    scale: float | None = None,
    dtype: torch.dtype = torch.float32,
    sides: int | None = None,
    safety: float = SAFETY,
    nan_ok: bool = False,
    msg: str = "",
) -> float:
    """Assert ``max |actual − expected| ≤ f32_tolerance(...)`` and return that largest error.

    Args:
        actual: The value computed in ``dtype`` (a tensor, a float or nested lists of floats).
        expected: The reference: a float64 tensor (``.double()`` model and inputs), an exact
            Python value, or another ``dtype`` result (then ``sides`` defaults to 2).
        reduction_size: See :func:`f32_tolerance`.
        scale: See :func:`f32_tolerance`; default ``max |expected|`` (right for a result that is
            itself the largest value on its path, e.g. a sum of same-signed terms).
        dtype: The working precision of ``actual``.
        sides: 1 or 2; default 2 when ``expected`` is a tensor of a dtype other than float64.
        safety: See :func:`f32_tolerance`.
        nan_ok: NaN equals NaN (at the same positions); otherwise a NaN fails.
        msg: Prefix of the failure message.

    >>> assert_close_f32(torch.tensor([1.0, 2.0]), [1.0, 2.0 + 1e-7], reduction_size=4) < 2e-7
    True
    >>> assert_close_f32(torch.tensor([1.0, 2.0]), [1.0, 2.01], reduction_size=4)
    Traceback (most recent call last):
    AssertionError: ...
    """
    if sides is None:
        float64_or_exact = not isinstance(expected, torch.Tensor) or expected.dtype == torch.float64
        sides = 1 if float64_or_exact else 2
    got, want = _as_double(actual), _as_double(expected)
    assert got.shape == want.shape, f"{msg} shape {tuple(got.shape)} != {tuple(want.shape)}"
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    if nan_ok:
        assert torch.equal(nan_got, nan_want), f"{msg} NaN at different positions: {got} vs {want}"
        got, want = got[~nan_got], want[~nan_want]
    assert not (torch.isnan(got).any() or torch.isnan(want).any()), f"{msg} NaN in {got} or {want}"
    if scale is None:
        scale = float(want.abs().max()) if want.numel() else 0.0
    tol = f32_tolerance(reduction_size=reduction_size, scale=scale, dtype=dtype, sides=sides, safety=safety)
    err = float((got - want).abs().max()) if got.numel() else 0.0
    _log(err, tol, msg)
    if not err <= tol:
        where = int((got - want).abs().flatten().argmax())
        raise AssertionError(
            f"{msg} greatest abs difference {err:.3e} > tolerance {tol:.3e} "
            f"(= {safety:g}·{sides}·sqrt({reduction_size})·eps({dtype})·{scale:.3g}); at flat index {where}: "
            f"{got.flatten()[where].item()!r} vs {want.flatten()[where].item()!r}"
        )
    return err


def _log(err: float, tol: float, msg: str) -> None:
    path = os.environ.get("GRPO_NUMERICS_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        ratio = err / tol if tol > 0 else (0.0 if err == 0 else math.inf)
        with open(path, "a") as f:
            f.write(f"{test}\t{msg}\t{err:.3e}\t{tol:.3e}\t{ratio:.4f}\n")

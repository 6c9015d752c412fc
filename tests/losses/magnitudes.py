"""The magnitude of the token terms a policy loss sums: the ``scale`` of its float32 rounding error
(``tests/numerics.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def term_magnitude(
    compute: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor],
    logps: torch.Tensor,
    advantages: torch.Tensor,
    entropies: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
) -> float:
    """``Σ_t w_t |L_t|``: the weighted token terms of a loss ``Σ_t w_t L_t``, in absolute value.

    A loss's float32 rounding error is relative to this, not to the loss itself (its terms may
    cancel). Found from one float64 run with the inputs made leaves: the policy terms are
    positively homogeneous of degree 1 in the advantage (clipping, gates and weights depend on its
    sign only) and the entropy bonus is linear in the entropy, so ``w_t |L_t| = |x_t ∂loss/∂x_t|``;
    the KL term ``k3(x) = eˣ − x − 1`` (``x = ℓ_ref − ℓ``) is at most ``|x (eˣ − 1)| = |x ∂k3/∂ℓ_ref|``.

    Args:
        compute: ``(advantages (B, T), entropies, ref_logps) -> loss``, everything float64.
        logps: ``(B, T)`` the current log-probs (for ``x``).
        advantages: ``(B,)`` advantages, given to ``compute`` per token.
        entropies: ``(B, T)`` or ``None``.
        ref_logps: ``(B, T)`` or ``None``.
    """
    rows, width = logps.shape
    adv = advantages.detach().double()[:, None].expand(rows, width).clone().requires_grad_(True)
    ent = None if entropies is None else entropies.detach().double().clone().requires_grad_(True)
    ref = None if ref_logps is None else ref_logps.detach().double().clone().requires_grad_(True)
    loss = compute(adv, ent, ref)
    leaves = [x for x in (adv, ent, ref) if x is not None]
    grads = dict(zip(map(id, leaves), torch.autograd.grad(loss, leaves, allow_unused=True)))
    total = torch.zeros((), dtype=torch.float64)
    for leaf, x in ((adv, adv), (ent, ent), (ref, None if ref is None else ref - logps.detach().double())):
        grad = None if leaf is None else grads[id(leaf)]
        if grad is not None:
            total = total + (x.detach() * grad).abs().sum()
    return float(total)

"""Log-probs and entropies straight from hidden states, through the LM head in chunks of tokens.

The plain path materialises ``(B, T, V)`` logits (and their fp32 copies) for every completion
position of the batch and keeps them alive until backward. Here the head runs on ``chunk_tokens``
hidden states at a time and, under autograd, nothing of size ``V`` is kept for backward: each
chunk's logits are recomputed there. Peak memory of the head is ``O(chunk_tokens · V)`` instead
of ``O(B · T · V)``.

Two backward implementations:

* an ``nn.Linear`` head (every supported architecture, tied or not) uses
  :class:`LinearHeadLogprobs`, a custom autograd function whose backward recomputes a chunk's
  logits with one matmul and forms ``∂/∂logits`` analytically, in place: one extra head matmul
  over the plain path and fewer elementwise passes over ``(n, V)``;
* any other head module (an adapter-wrapped head, say) runs each chunk under non-reentrant
  activation checkpointing.

Layer L0: pure torch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _transform_(
    logits: torch.Tensor, logit_scale: float | None, softcap: float | None, temperature: float
) -> torch.Tensor:
    """In place: ``softcap·tanh(logits·scale / softcap) / temperature`` (each step only when set)."""
    if logit_scale is not None:
        logits.mul_(logit_scale)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _transform(
    logits: torch.Tensor, logit_scale: float | None, softcap: float | None, temperature: float
) -> torch.Tensor:
    """Out of place (autograd) version of :func:`_transform_`."""
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def _expected_logit(logits: torch.Tensor, log_norm: torch.Tensor) -> torch.Tensor:
    """``Σ_v p_v z_v`` per row, with ``p = exp(z − log_norm)``; one ``(n, V)`` temporary."""
    probs = (logits - log_norm.unsqueeze(-1)).exp_()
    return torch.bmm(probs.unsqueeze(1), logits.unsqueeze(2)).view(-1)


def _linear_compute(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Logits of one chunk in float32; the matmul in the (already cast) weight's dtype, as
    ``F.linear`` under autocast would run it."""
    return F.linear(hidden.to(weight.dtype), weight, bias).float()


def _compute_weights(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """The head's weight and bias cast once to the compute dtype (no copy when already in it)."""
    return weight.to(dtype), None if bias is None else bias.to(dtype)


class LinearHeadLogprobs(torch.autograd.Function):
    """Chunked ``log softmax(transform(h Wᵀ + b))[y]`` and entropy with an analytic, recomputing backward.

    Saves only ``hidden``, the weights, the token ids and two per-token statistics (row maximum
    and normaliser of the logits); the backward recomputes one chunk of logits at a time.

    With ``z = transform(a)`` and ``p = softmax(z)``: ``∂ℓ/∂z = e_y − p`` and
    ``∂H/∂z = −p ⊙ (z − E_p[z])``; ``transform`` contributes ``scale / temperature`` and, with
    soft-capping, ``1 − tanh²``.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, token_ids, temperature, logit_scale, softcap, chunk, with_entropy, entropy_grad
    ):
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        logp_chunks, max_chunks, sum_chunks, mean_chunks = [], [], [], []
        compute_weight, compute_bias = _compute_weights(weight, bias, dtype)
        with torch.autocast(device_type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                ids = token_ids[start : start + chunk]
                logits = _linear_compute(hidden[start : start + chunk], compute_weight, compute_bias)
                logits = _transform_(logits, logit_scale, softcap, temperature)
                # log Z = m + log Σ exp(z − m), keeping m and the sum: backward rebuilds
                # p = exp(z − m) / sum as softmax does (exp(z − log Z) loses digits when |z| is large).
                row_max = logits.amax(dim=-1)
                unnormalised = (logits - row_max.unsqueeze(-1)).exp_()
                row_sum = unnormalised.sum(-1)
                log_norm = row_max + row_sum.log()
                logp_chunks.append(logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - log_norm)
                max_chunks.append(row_max)
                sum_chunks.append(row_sum)
                if with_entropy:  # E_p[z] = Σ exp(z − m) z / sum
                    mean_chunks.append(torch.bmm(unnormalised.unsqueeze(1), logits.unsqueeze(2)).view(-1) / row_sum)
                del logits, unnormalised
        del compute_weight, compute_bias
        logps, row_max, row_sum = torch.cat(logp_chunks), torch.cat(max_chunks), torch.cat(sum_chunks)
        log_norm = row_max + row_sum.log()
        expected = torch.cat(mean_chunks) if with_entropy else log_norm.new_zeros(0)
        entropies = log_norm - expected if with_entropy else log_norm.new_zeros(0)
        ctx.save_for_backward(hidden, weight, bias, token_ids, row_max, row_sum)
        ctx.settings = (dtype, temperature, logit_scale, softcap, chunk, with_entropy and entropy_grad)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps, grad_entropies):
        hidden, weight, bias, token_ids, row_max, row_sum = ctx.saved_tensors
        dtype, temperature, logit_scale, softcap, chunk, entropy_grad = ctx.settings
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        if grad_logps is None:
            grad_logps = torch.zeros_like(row_max)
        use_entropy = entropy_grad and grad_entropies is not None
        scale = (1.0 if logit_scale is None else logit_scale) / temperature
        compute_weight, compute_bias = _compute_weights(weight, bias, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h = hidden[rows]
                g = grad_logps[rows].float().unsqueeze(-1)  # (n, 1)
                logits = _linear_compute(h, compute_weight, compute_bias)
                logits = _transform_(logits, logit_scale, softcap, temperature)
                grad = (logits - row_max[rows].unsqueeze(-1)).exp_().div_(row_sum[rows].unsqueeze(-1))  # p
                if use_entropy:  # ∂/∂z = −p ⊙ (g + g_H (z − E z)) + g e_y
                    mean = torch.bmm(grad.unsqueeze(1), logits.unsqueeze(2)).view(-1, 1)  # E_p[z], recomputed
                    coef = (logits - mean).mul_(grad_entropies[rows].float().unsqueeze(-1)).add_(g)
                    grad.mul_(coef).neg_()
                    del coef
                else:
                    grad.mul_(-g)
                grad.scatter_add_(1, token_ids[rows].unsqueeze(-1), g)
                if softcap is not None:  # d(c·tanh(u/c))/du = 1 − (v/c)², v = z·temperature
                    grad.mul_(logits.mul_(temperature / softcap).square_().neg_().add_(1.0))
                del logits
                grad.mul_(scale)
                grad = grad.to(dtype)
                if need_hidden:
                    grad_hidden[rows] = (grad @ compute_weight).to(hidden.dtype)
                if need_weight:
                    grad_weight += (grad.t() @ h.to(dtype)).float()
                if need_bias:
                    grad_bias += grad.float().sum(0)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _chunk_logprobs(
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    logit_scale: float | None,
    softcap: float | None,
    with_entropy: bool,
    entropy_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk through any head module, with autograd (or in place without it)."""
    grad = torch.is_grad_enabled()
    logits = head(hidden).float()  # (n, V)
    transform = _transform if grad else _transform_  # in place without autograd
    logits = transform(logits, logit_scale, softcap, temperature)
    log_norm = torch.logsumexp(logits, dim=-1)  # (n,)
    logps = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - log_norm
    entropies = None
    if with_entropy:
        # After the log-probs: when the entropy needs no grad, checkpoint recomputation stops
        # before reaching it (early stop once every saved tensor is recomputed).
        if entropy_requires_grad and grad:
            probs = torch.softmax(logits, dim=-1)
            entropies = log_norm - (probs * logits).sum(-1)
        else:
            with torch.no_grad():
                entropies = log_norm.detach() - _expected_logit(logits, log_norm)
    return logps, entropies


def is_plain_linear(head: object) -> bool:
    """Whether ``head`` is an ``nn.Linear`` whose forward is ``nn.Linear``'s (no override)."""
    return isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward


def linear_function(head: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """``head``'s map as a function of its weight and bias, not a call of the module (no hooks)."""
    return lambda hidden: torch.nn.functional.linear(hidden, head.weight, head.bias)


def reads_head_weight(head: object, recompute: bool) -> bool:
    """Whether :func:`chunked_head_logprobs` reads ``head.weight`` itself (the analytic backward of
    a plain ``nn.Linear`` under grad) rather than calling ``head`` on each chunk."""
    return recompute and torch.is_grad_enabled() and is_plain_linear(head)


def chunked_head_logprobs(
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = 1024,
    logit_scale: float | None = None,
    softcap: float | None = None,
    with_entropy: bool = True,
    entropy_requires_grad: bool = False,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of ``token_ids`` (and entropies) from the hidden states that predict them.

    The logits of a token are ``softcap·tanh(head(h)·logit_scale / softcap) / temperature``
    (each step only when set), in float32: the same distribution as
    :func:`~grpo_lightning.algo.logprobs.token_logprobs_and_entropy` on the model's logits.

    Args:
        hidden: ``(M, H)`` final hidden states, one per predicted token.
        token_ids: ``(M,)`` the tokens whose log-probs are wanted.
        head: maps ``(n, H)`` hidden states to ``(n, V)`` logits (the LM head module).
        temperature: logits are divided by it.
        chunk_tokens: tokens through the head at once; ``None`` runs all ``M`` in one chunk.
        logit_scale: multiplies the head output (Cohere ``logit_scale``, 1/Granite
            ``logits_scaling``); ``None`` skips it.
        softcap: final logit soft-capping (Gemma 2/3 ``final_logit_softcapping``); ``None`` skips it.
        with_entropy: also return ``-Σ_v p log p`` per token.
        entropy_requires_grad: keep the entropy in the autograd graph (entropy bonus).
        recompute: under autograd, keep nothing of size ``V`` for backward and recompute each
            chunk's logits there. ``False`` keeps them (the plain memory profile).

    Returns:
        ``(logps (M,) float32, entropies (M,) float32 or None)``.

    >>> head = torch.nn.Linear(2, 3, bias=False)
    >>> with torch.no_grad():
    ...     _ = head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    >>> h = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    >>> lp, ent = chunked_head_logprobs(h, torch.tensor([0, 2]), head, chunk_tokens=1)
    >>> [round(x, 4) for x in lp.tolist()], [round(x, 4) for x in ent.tolist()]
    ([-1.0986, -2.2395], [1.0986, 0.6656])
    """
    if hidden.dim() != 2 or token_ids.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be (M, H) and token_ids (M,); got {tuple(hidden.shape)} and {tuple(token_ids.shape)}."
        )
    total = hidden.shape[0]
    if total == 0:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    step = total if chunk_tokens is None else max(int(chunk_tokens), 1)
    grad = torch.is_grad_enabled()
    if reads_head_weight(head, recompute):
        logps, entropies = LinearHeadLogprobs.apply(
            hidden, head.weight, head.bias, token_ids, float(temperature), logit_scale, softcap, step,
            with_entropy, entropy_requires_grad,
        )
        return logps, (entropies if with_entropy else None)
    use_checkpoint = recompute and grad
    args = (head, temperature, logit_scale, softcap, with_entropy, entropy_requires_grad)
    logp_chunks, entropy_chunks = [], []
    for start in range(0, total, step):
        h, ids = hidden[start : start + step], token_ids[start : start + step]
        if use_checkpoint:
            logps, entropies = checkpoint(
                _chunk_logprobs, h, ids, *args, use_reentrant=False, preserve_rng_state=False
            )
        else:
            logps, entropies = _chunk_logprobs(h, ids, *args)
        logp_chunks.append(logps)
        if with_entropy:
            entropy_chunks.append(entropies)
    logps = torch.cat(logp_chunks)
    entropies = torch.cat(entropy_chunks) if with_entropy else None
    return logps, entropies

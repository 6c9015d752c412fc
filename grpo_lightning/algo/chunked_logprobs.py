"""Log-probs and entropies straight from hidden states, through the LM head in chunks of tokens.

The plain path materialises ``(B, T, V)`` logits (and their fp32 copies) for every completion
position of the batch and keeps them alive until backward. Here the head runs on ``chunk_tokens``
hidden states at a time; with autograd each chunk is wrapped in non-reentrant activation
checkpointing, so the forward keeps only the per-token results and the backward recomputes one
chunk's logits at a time. Peak memory of the head is ``O(chunk_tokens · V)`` instead of
``O(B · T · V)``, for one extra head matmul per chunk in backward.

Layer L0: pure torch.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint


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
    """One chunk: ``(n, H)`` hidden states → ``(n,)`` log-probs of ``token_ids`` (and entropies).

    Holds at most about three ``(n, V)`` fp32 tensors at once; without autograd the logit
    transforms run in place.
    """
    grad = torch.is_grad_enabled()
    logits = head(hidden).float()  # (n, V)
    if grad:
        if logit_scale is not None:
            logits = logits * logit_scale
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if temperature != 1.0:
            logits = logits / temperature
    else:
        if logit_scale is not None:
            logits.mul_(logit_scale)
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        if temperature != 1.0:
            logits.div_(temperature)
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
                probs = torch.softmax(logits, dim=-1)
                expected = torch.bmm(probs.unsqueeze(1), logits.unsqueeze(2)).view(-1)  # Σ_v p·z, no (n, V) product
                del probs
                entropies = log_norm.detach() - expected
    return logps, entropies


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
        recompute: under autograd, checkpoint each chunk so that its logits are freed after the
            forward and recomputed in backward. ``False`` keeps them (the plain memory profile).

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
    step = total if chunk_tokens is None else int(chunk_tokens)
    if step < 1:
        step = max(total, 1)
    use_checkpoint = recompute and torch.is_grad_enabled()
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
    if not logp_chunks:  # no tokens
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    logps = torch.cat(logp_chunks)
    entropies = torch.cat(entropy_chunks) if with_entropy else None
    return logps, entropies

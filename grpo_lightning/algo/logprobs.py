"""Per-token log-probabilities and entropies from logits, without materialising more than needed.

Layer L0: pure torch.
"""

from __future__ import annotations

import torch


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = True,
    entropy_requires_grad: bool = False,
    chunk_rows: int = 8,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``token_ids`` under ``softmax(logits / temperature)`` and the entropy.

    Works on chunks of rows so that only one chunk of logits is ever held in float32 at a time
    (the model may return bf16 logits; the softmax always runs in fp32, as TRL does in practice).

    Args:
        logits: ``(B, T, V)`` next-token logits aligned with ``token_ids``.
        token_ids: ``(B, T)`` the sampled tokens.
        temperature: the sampling temperature; the distribution trained is the one sampled from.
        with_entropy: also return the per-token entropy ``-Σ_v p log p``.
        entropy_requires_grad: keep the entropy in the autograd graph (entropy bonus); otherwise
            it is computed under ``no_grad`` for logging only.
        chunk_rows: rows converted to fp32 at once.

    Returns:
        ``(logps (B, T) float32, entropies (B, T) float32 or None)``.

    >>> logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])
    >>> lp, h = token_logprobs_and_entropy(logits, torch.tensor([[0, 1]]))
    >>> [round(x, 4) for x in lp[0].tolist()], [round(x, 4) for x in h[0].tolist()]
    ([-0.6931, -2.1269], [0.6931, 0.3653])
    """
    logp_chunks, entropy_chunks = [], []
    for start in range(0, logits.shape[0], chunk_rows):
        chunk = logits[start : start + chunk_rows].float() / temperature  # (b, T, V)
        ids = token_ids[start : start + chunk_rows]
        log_norm = torch.logsumexp(chunk, dim=-1)  # (b, T)
        picked = chunk.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (b, T)
        logp_chunks.append(picked - log_norm)
        if with_entropy:
            with torch.set_grad_enabled(entropy_requires_grad and torch.is_grad_enabled()):
                probs = torch.softmax(chunk, dim=-1)
                entropy_chunks.append(log_norm - (probs * chunk).sum(-1))
    logps = torch.cat(logp_chunks)
    entropies = torch.cat(entropy_chunks) if with_entropy else None
    return logps, entropies

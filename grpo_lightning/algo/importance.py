"""Importance-sampling correction for the sampler/trainer mismatch (spec §3.8).

Layer L0: torch only. A sampler that keeps its own copy of the weights (vLLM, a server) or its
own kernels (paged attention, bf16) samples from a slightly different distribution than the
trainer's policy. Its per-token log-probs ``ℓ^samp`` and the trainer's log-probs of the same
tokens at generation time ``ℓ_old`` give the correction weight ``ρ`` that multiplies the per-token
loss (after clipping, before the KL term):

    d_{i,t} = (ℓ_old_{i,t} − ℓ^samp_{i,t}) · m_{i,t}        (B, T), m = loss mask
    token modes:     ρ_{i,t} = exp(d_{i,t})                 (B, T)
    sequence modes:  ρ_i     = exp(Σ_t d_{i,t})             (B, 1)  (product of token ratios)
    *_truncate:      ρ = clamp(ρ, clip_min, clip_max)
    *_mask:          ρ = 0 where ρ < clip_min or ρ > clip_max

``ρ`` is computed once per generation batch and reused for every replay of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclass(frozen=True)
class ImportanceSamplingCorrection:
    """Correct the loss for the gap between the sampler's and the trainer's log-probs.

    Applies whenever the sampler returns per-token log-probs (vLLM colocate/server, continuous
    batching); samplers without them (``hf_generate``) sample from the live policy itself. Turning
    it on costs one no-grad forward of each generation batch (the trainer's log-probs at
    generation time), as in TRL.

    Args:
        enabled: Apply the correction (TRL: ``vllm_importance_sampling_correction``).
        mode: ``token_truncate`` / ``token_mask`` weight each token by its own ratio;
            ``sequence_truncate`` / ``sequence_mask`` weight a whole completion by the product of
            its token ratios. ``*_truncate`` clamps ratios into ``[clip_min, clip_max]``;
            ``*_mask`` zeroes them outside it (TRL: ``vllm_importance_sampling_mode``).
        clip_min: Lower bound of the ratio; ``None`` = no lower bound
            (TRL: ``vllm_importance_sampling_clip_min``).
        clip_max: Upper bound of the ratio; ``None`` = no upper bound
            (TRL: ``vllm_importance_sampling_clip_max``, formerly ``vllm_importance_sampling_cap``).
    """

    enabled: bool = True
    mode: ImportanceSamplingMode = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    def __post_init__(self) -> None:
        if self.mode not in IMPORTANCE_SAMPLING_MODES:
            raise ValueError(
                f"data.importance_sampling.mode={self.mode!r}: use one of {', '.join(IMPORTANCE_SAMPLING_MODES)}."
            )
        if self.clip_min is None and self.clip_max is None:
            raise ValueError(
                "data.importance_sampling: clip_min and clip_max are both null, which bounds nothing; set "
                "clip_max (default 3.0), or turn the correction off with enabled: false."
            )
        if self.clip_min is not None and self.clip_max is not None and self.clip_min > self.clip_max:
            raise ValueError(
                f"data.importance_sampling: clip_min={self.clip_min} is above clip_max={self.clip_max}."
            )
        if self.clip_max is not None and self.clip_max <= 0:
            raise ValueError(f"data.importance_sampling.clip_max={self.clip_max}: ratios are positive; use > 0 "
                             "(TRL's default is 3.0).")
        if self.clip_min is not None and self.clip_min < 0:
            raise ValueError(f"data.importance_sampling.clip_min={self.clip_min}: ratios are positive; use >= 0.")

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence")


def importance_sampling_weights(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    correction: ImportanceSamplingCorrection,
) -> torch.Tensor:
    """The correction weights ``ρ``: ``(B, T)`` in token modes, ``(B, 1)`` in sequence modes.

    Args:
        old_logps: ``(B, T)`` trainer log-probs of the sampled tokens at generation time.
        sampling_logps: ``(B, T)`` the sampler's log-probs of the same tokens.
        mask: ``(B, T)`` loss mask (1 = a token the loss sees); masked tokens contribute
            ``d = 0`` (ratio 1), and so do tokens whose sampler log-prob is NaN.

    Computed in float64 so a long sequence's sum of small differences does not lose digits.

    >>> old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    >>> samp = torch.tensor([[-1.5, -2.0], [-1.0, 0.5]])
    >>> mask = torch.tensor([[1, 1], [1, 0]])
    >>> importance_sampling_weights(old, samp, mask, ImportanceSamplingCorrection(mode="token_truncate"))
    tensor([[1.6487, 1.0000],
            [1.0000, 1.0000]])
    >>> importance_sampling_weights(old, samp, mask, ImportanceSamplingCorrection(mode="sequence_mask", clip_max=1.5))
    tensor([[0.],
            [1.]])
    """
    # A token the sampler could not score (NaN log-prob) gets d = 0: ratio 1, no correction, as TRL.
    difference = torch.nan_to_num((old_logps.double() - sampling_logps.double()) * mask, nan=0.0)  # (B, T)
    log_ratio = difference.sum(dim=1, keepdim=True) if correction.per_sequence else difference  # (B, 1) | (B, T)
    ratio = torch.exp(log_ratio)
    low = -float("inf") if correction.clip_min is None else correction.clip_min
    high = float("inf") if correction.clip_max is None else correction.clip_max
    if correction.mode.endswith("truncate"):
        ratio = ratio.clamp(min=low, max=high)
    else:
        ratio = torch.where((ratio < low) | (ratio > high), torch.zeros_like(ratio), ratio)
    return ratio.to(old_logps.dtype)


@dataclass(frozen=True)
class SamplingStats:
    """One rank's sums and extremes behind the ``sampling/*`` metrics, reduced over ranks by
    :func:`sampling_metrics` (a ``(7,)`` tensor in :meth:`as_tensor` order)."""

    difference_sum: float  # Σ |ℓ_old − ℓ^samp| over loss tokens
    difference_max: float
    token_count: float
    ratio_sum: float  # Σ ρ over loss tokens (token modes) or sequences (sequence modes)
    ratio_count: float
    ratio_min: float
    ratio_max: float

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(
            [self.difference_sum, self.difference_max, self.token_count, self.ratio_sum, self.ratio_count,
             self.ratio_min, self.ratio_max], dtype=torch.float64,
        )  # fmt: skip


def sampling_stats(
    old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor,
    per_sequence: bool, rows: torch.Tensor | None = None,
) -> SamplingStats:
    """This rank's statistics of the log-prob gap and of ``ρ``.

    ``weights``: ``(B, 1)`` when ``per_sequence`` (sequence modes), else ``(B, T)`` (token modes;
    told, not inferred from the shape: a batch of one-token completions is ``(B, 1)`` too).
    ``rows``: ``(B,)`` bool, the rows that count (``None``: all). The gap and token-mode ratios
    are taken over loss tokens, the gap without tokens the sampler could not score (NaN: counting
    them as 0 would understate it); sequence-mode ratios over the counted sequences.
    """
    tokens = mask.bool()
    if rows is not None:
        tokens = tokens & rows[:, None]
    gap = (old_logps.double() - sampling_logps.double()).abs()  # (B, T)
    gap = gap[tokens & ~torch.isnan(gap)]
    if per_sequence:  # (B, 1)
        ratios = weights.double()[:, 0] if rows is None else weights.double()[rows, 0]
    else:  # (B, T)
        ratios = weights.double()[tokens]
    inf = float("inf")
    return SamplingStats(
        difference_sum=float(gap.sum()),
        difference_max=float(gap.max()) if gap.numel() else -inf,
        token_count=float(gap.numel()),
        ratio_sum=float(ratios.sum()),
        ratio_count=float(ratios.numel()),
        ratio_min=float(ratios.min()) if ratios.numel() else inf,
        ratio_max=float(ratios.max()) if ratios.numel() else -inf,
    )


def sampling_metrics(per_rank: torch.Tensor) -> dict[str, float]:
    """The ``sampling/*`` metrics from every rank's :meth:`SamplingStats.as_tensor` rows ``(P, 7)``.

    Means are over all ranks' tokens (or sequences) together: TRL averages the per-rank means,
    which weights a rank with short completions like one with long ones.
    """
    totals = per_rank.double()
    token_count, ratio_count = totals[:, 2].sum(), totals[:, 4].sum()
    nan = float("nan")
    return {
        "sampling/sampling_logp_difference/mean": float(totals[:, 0].sum() / token_count) if token_count else nan,
        "sampling/sampling_logp_difference/max": float(totals[:, 1].max()) if token_count else nan,
        "sampling/importance_sampling_ratio/min": float(totals[:, 5].min()) if ratio_count else nan,
        "sampling/importance_sampling_ratio/mean": float(totals[:, 3].sum() / ratio_count) if ratio_count else nan,
        "sampling/importance_sampling_ratio/max": float(totals[:, 6].max()) if ratio_count else nan,
    }

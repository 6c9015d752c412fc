"""``lm_head_chunk_tokens: auto``: the LM-head chunk size from a measurement on the current device.

The chunked head (:mod:`grpo_lightning.algo.chunked_logprobs`) runs ``chunk × V`` logits at a
time with a recompute in backward. Small chunks cost launches and cache passes, large ones
memory (about three ``chunk × V`` fp32 buffers). On CUDA the fastest size depends on the GPU and
the vocabulary, so ``auto`` times one forward+backward of a few candidate sizes on the real head
(the same ``chunked_head_logprobs`` call the training pass makes), once per (device, head
shape, dtype) per process, and keeps the fastest that fits in a quarter of the free memory.
On CPU ``auto`` is :data:`CPU_CHUNK_TOKENS` without a measurement: a CPU measurement would
take seconds of 151K-wide head matmuls, and the CPU benchmarks run with 1024.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

from grpo_lightning.algo.chunked_logprobs import chunked_head_logprobs

log = logging.getLogger(__name__)

CPU_CHUNK_TOKENS = 1024
CANDIDATES: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
_cache: dict[tuple, int] = {}


def pick_fastest(
    candidates: Sequence[int], run: Callable[[int], None], timer: Callable[[], float] = time.perf_counter, repeats: int = 2
) -> tuple[int, dict[int, float]]:
    """The candidate whose ``run`` takes least time (best of ``repeats`` after one warm-up call),
    the smallest on ties; and every candidate's time.

    >>> ticks = iter([0, 5, 5, 7, 0, 2, 2, 3])  # 1024: 5 s then 2 s, 2048: 2 s then 1 s
    >>> pick_fastest([1024, 2048], lambda c: None, timer=lambda: next(ticks))
    (2048, {1024: 2, 2048: 1})
    """
    if not candidates:
        raise ValueError("pick_fastest: no candidate chunk sizes")
    times: dict[int, float] = {}
    for chunk in candidates:
        run(chunk)  # warm-up (allocator, kernel selection)
        best = float("inf")
        for _ in range(repeats):
            start = timer()
            run(chunk)
            best = min(best, timer() - start)
        times[chunk] = best
    return min(candidates, key=lambda c: (times[c], c)), times


def fitting_candidates(vocab: int, free_bytes: int, candidates: Sequence[int] = CANDIDATES) -> list[int]:
    """Candidates whose three ``chunk × vocab`` fp32 buffers fit in a quarter of ``free_bytes``
    (at least the smallest candidate).

    >>> fitting_candidates(151_936, 8 * 2**30)
    [1024]
    >>> fitting_candidates(151_936, 128 * 2**30)
    [1024, 2048, 4096, 8192, 16384]
    """
    fits = [c for c in candidates if 3 * c * vocab * 4 <= free_bytes // 4]
    return fits or [min(candidates)]


def auto_chunk_tokens(head: torch.nn.Module, hidden_size: int, device: torch.device, dtype: torch.dtype) -> int:
    """The chunk size for ``head`` on ``device`` (cached; see the module docstring)."""
    if device.type != "cuda":
        return CPU_CHUNK_TOKENS
    weight = head.weight
    key = (str(device), tuple(weight.shape), weight.dtype, dtype)
    if key in _cache:
        return _cache[key]
    vocab = int(weight.shape[0])
    free, _ = torch.cuda.mem_get_info(device)
    candidates = fitting_candidates(vocab, free)
    tokens = 2 * max(candidates)
    # A copy of the head: the timed backward must not touch the policy's gradients or DDP hooks.
    probe = torch.nn.Linear(weight.shape[1], vocab, bias=getattr(head, "bias", None) is not None, device=device)
    with torch.no_grad():
        probe.weight.copy_(weight)
    # a private generator: calibrating (once per process, so again after a resume) draws nothing
    # from the global streams that sampling and dropout use
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device=device, dtype=dtype, generator=generator).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)

    def run(chunk: int) -> None:
        logps, _ = chunked_head_logprobs(hidden, targets, probe, 1.0, chunk_tokens=chunk, with_entropy=False)
        logps.sum().backward()
        torch.cuda.synchronize(device)

    chunk, times = pick_fastest(candidates, run)
    del probe, hidden
    _cache[key] = chunk
    log.info("lm_head_chunk_tokens=auto on %s: %d (seconds per %d tokens: %s)", device, chunk, tokens,
             {c: round(t, 4) for c, t in times.items()})
    return chunk


def measured_chunk_tokens() -> list[int]:
    """The chunk sizes ``auto`` has picked in this process so far (one per measured head)."""
    return sorted(set(_cache.values()))


def resolve_chunk_tokens(value: int | str, head: torch.nn.Module, hidden: torch.Tensor) -> int:
    """``ForwardOptions.lm_head_chunk_tokens`` as a number: itself, or :func:`auto_chunk_tokens`
    for ``"auto"`` (``hidden``: the ``(M, H)`` states the head will run on)."""
    if value != "auto":
        return int(value)
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.ndim != 2:
        return CPU_CHUNK_TOKENS
    dtype = torch.get_autocast_dtype("cuda") if hidden.is_cuda and torch.is_autocast_enabled("cuda") else hidden.dtype
    return auto_chunk_tokens(head, hidden.shape[-1], hidden.device, dtype)


def planned_chunk_tokens(value: int | str, device: torch.device) -> int:
    """The chunk size a memory estimate assumes: ``value``, or for ``"auto"`` the largest
    :data:`CANDIDATES` on CUDA (the calibration may pick it) and :data:`CPU_CHUNK_TOKENS` elsewhere.

    >>> planned_chunk_tokens("auto", torch.device("cpu")), planned_chunk_tokens("auto", torch.device("cuda")), planned_chunk_tokens(64, torch.device("cuda"))
    (1024, 16384, 64)
    """
    if value != "auto":
        return int(value)
    return max(CANDIDATES) if device.type == "cuda" else CPU_CHUNK_TOKENS

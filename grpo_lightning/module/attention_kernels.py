"""Attention kernels for the packed and prompt-shared forwards (``ForwardOptions.attention_kernel``).

With ``sdpa`` a packed layout is isolated by a materialised mask (transformers builds a
block-diagonal one from restarting position ids; the shared-prefix layout passes its own 4-D
mask), and sdpa's flash kernel takes no mask, so CUDA falls back to a slower kernel. The kernels:

* ``sdpa_mask``: that mask path (the only one on CPU: flex attention has no CPU backward);
* ``flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` of the same mask
  (document-causal for packing, the prompt-sharing mask for shared prefixes), compiled on CUDA;
* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash, ``cu_seqlens``) over the
  flattened packed tokens; packing without a shared prompt only (a tree mask is not a set of
  independent sequences), bf16/fp16 on CUDA. Otherwise the same attention runs as flex with the
  document mask (CUDA: float32, dropout aside) or as sdpa with the block-diagonal mask (CPU: the
  tests run that path);
* ``auto``: on CUDA ``flex`` for a shared prompt and ``varlen`` for plain packing; ``sdpa_mask``
  elsewhere.

How the kernel reaches the layers: :func:`install` wraps transformers' ``sdpa`` entry of
``ALL_ATTENTION_FUNCTIONS`` once. The wrapper runs flex when it is given a ``BlockMask`` and
varlen when given a ``grpo_varlen`` keyword (a :class:`VarlenSequences`); any other call goes to
the original sdpa unchanged (an sdpa call with either input would fail). A 4-D mask passes
through transformers' mask preparation as-is, and both inputs reach the attention function as
arguments of the decoder layer, so gradient checkpointing's recompute sees them again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_lightning.algo.block_masks import (
    block_mask,
    cu_seqlens,
    dense_mask,
    dense_mask_mod,
    document_causal_mask_mod,
    sequence_ids,
)
from grpo_lightning.algo.packing import TokenLayout, to_device

log = logging.getLogger(__name__)

ATTENTION_KERNELS = ("auto", "sdpa_mask", "flex", "varlen")
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class VarlenSequences:
    """The packed sequences of a ``(R, W)`` layout for a varlen kernel.

    Attributes:
        cu_seqlens: ``(S + 1,)`` int32 offsets of the sequences in the flattened ``R·W`` tokens.
        max_seqlen: the longest sequence.
        seq_ids: ``(R, W)`` sequence id of each slot (the fallbacks' masks).
        cache: the fallback's mask, built at the first layer and reused by the others.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_ids: torch.Tensor
    cache: dict = field(default_factory=dict, compare=False, repr=False)


# Rows of a prompt-shared layout under flex: its mask is built dense per row first ((W, W) bools),
# so rows stay within max(this, the largest prompt unit) tokens.
SHARED_ROW_TOKENS = 8192


def requested_kernel(requested: str, attn_implementation: str, sliding_window: int | None, device: torch.device) -> str:
    """The kernel a packed forward plans with before its layout is known: ``sdpa_mask`` unless the
    model attends with ``sdpa`` and no sliding window (a passed 4-D mask replaces transformers'
    sliding-window masks); otherwise ``requested`` resolved for an unshared layout.

    >>> requested_kernel("auto", "sdpa", None, torch.device("cuda")), requested_kernel("flex", "eager", None, torch.device("cuda"))
    ('varlen', 'sdpa_mask')
    """
    kernel = resolve_kernel(requested, device, shared=False)
    if kernel != "sdpa_mask" and (attn_implementation != "sdpa" or sliding_window):
        why = f"attention implementation {attn_implementation!r}" if attn_implementation != "sdpa" else "a sliding window"
        if why not in _logged:
            _logged.add(why)
            log.info("forward.attention_kernel=%s not used with %s: the mask path runs.", requested, why)
        return "sdpa_mask"
    return kernel


def resolve_kernel(requested: str, device: torch.device, *, shared: bool) -> str:
    """The kernel a layout uses: ``auto`` -> ``flex`` (shared prompt) / ``varlen`` (packing) on
    CUDA, ``sdpa_mask`` elsewhere; ``varlen`` with a shared prompt -> ``flex`` (varlen sequences
    cannot share a prefix), and on CUDA without :func:`varlen_supported` -> ``flex``.

    >>> resolve_kernel("auto", torch.device("cpu"), shared=True), resolve_kernel("varlen", torch.device("cuda"), shared=True)
    ('sdpa_mask', 'flex')
    """
    if requested not in ATTENTION_KERNELS:
        raise ValueError(f"forward.attention_kernel={requested!r}: use one of {', '.join(ATTENTION_KERNELS)}.")
    if requested == "auto":
        if device.type != "cuda":
            return "sdpa_mask"
        requested = "varlen"
    if requested == "varlen" and (shared or (device.type == "cuda" and not varlen_supported())):
        return "flex"
    return requested


def varlen_supported() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` with the ``scale``,
    ``enable_gqa`` and ``window_size`` (causality) arguments the kernel passes; older releases
    (``is_causal``) run ``varlen`` as ``flex``."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return {"scale", "enable_gqa", "window_size"} <= set(inspect.signature(varlen_attn).parameters)


def kernel_inputs(layout: TokenLayout, kernel: str) -> tuple[torch.Tensor | Any | None, dict[str, Any]]:
    """``(attention_mask, extra keyword arguments)`` for the decoder forward of a packed
    ``layout`` under ``kernel`` (a resolved one). ``sdpa_mask``: the layout's own mask."""
    if kernel == "sdpa_mask":
        return layout.attention_mask, {}
    install()
    rows, width = layout.input_ids.shape
    device = layout.input_ids.device
    if kernel == "flex":
        if layout.attention_mask is not None:  # shared prefix: its (R, 1, W, W) mask
            mod = dense_mask_mod(layout.attention_mask)
        else:
            mod = document_causal_mask_mod(sequence_ids(layout.position_ids))
        return block_mask(mod, rows, width, device), {}
    if kernel == "varlen":
        if layout.attention_mask is not None:
            raise ValueError("the varlen kernel cannot run a shared-prefix layout (resolve_kernel picks flex)")
        # Offsets and the longest sequence from the host copy: max_seqlen is a Python int, and
        # reading it from the device would wait for the queued kernels.
        positions = layout.position_ids if layout.host_position_ids is None else layout.host_position_ids
        offsets, longest = cu_seqlens(positions)
        sequences = VarlenSequences(to_device(offsets, device), longest, to_device(sequence_ids(positions), device))
        # A 4-D placeholder: transformers' mask preparation passes 4-D masks through untouched
        # (no (W, W) mask is built); only the wrapper below reads the sequences.
        placeholder = torch.zeros((rows, 1, 0, 0), dtype=torch.bool, device=device)
        return placeholder, {"grpo_varlen": sequences}
    raise ValueError(f"unknown resolved attention kernel {kernel!r}")


_original_sdpa: Any = None
_compiled_flex: Any = None
_logged: set[str] = set()


def install() -> None:
    """Wrap transformers' ``sdpa`` attention entry with the kernel dispatch (idempotent)."""
    global _original_sdpa
    if _original_sdpa is not None:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _original_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS.register("sdpa", _dispatch)


def _dispatch(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query (B, H, S, D)``, ``key/value (B, Hkv, S, D)``;
    returns ``(B, S, H, D)`` and no weights."""
    sequences = kwargs.pop("grpo_varlen", None)
    if sequences is not None:
        return _varlen(module, query, key, value, sequences, dropout, scaling, kwargs)
    if _is_block_mask(attention_mask):
        if dropout:
            raise ValueError("flex attention kernel: attention dropout is not supported; set it to 0 in the config.")
        if not _flex_takes(query):
            # Head sizes the compiled flex kernel may refuse: the same mask, dense, through sdpa.
            if "head_dim" not in _logged:
                _logged.add("head_dim")
                log.info("flex attention kernel: head_dim %d is not a power of two >= 16; sdpa with the dense mask.",
                         query.shape[-1])
            dense = getattr(attention_mask, "_grpo_dense", None)
            if dense is None:  # built at the first layer, reused by the others
                dense = dense_mask(attention_mask.mask_mod, query.shape[0], query.shape[2], query.device)
                attention_mask._grpo_dense = dense
            return _original_sdpa(module, query, key, value, dense, dropout=dropout, scaling=scaling, **kwargs)
        return _flex(query, key, value, attention_mask, scaling), None
    return _original_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _flex_takes(query: torch.Tensor) -> bool:
    """Off CUDA flex runs eagerly (any head size); compiled on CUDA, head sizes that are a power
    of two >= 16 (others may not compile on every torch release)."""
    dim = query.shape[-1]
    return not query.is_cuda or (dim >= 16 and dim & (dim - 1) == 0)


def _is_block_mask(mask: Any) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention
        return False
    return isinstance(mask, BlockMask)


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, scaling: float | None) -> torch.Tensor:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if query.is_cuda:  # eager flex is a slow reference implementation; CPU has no backward at all
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        fn = _compiled_flex
    gqa = query.shape[1] != key.shape[1]
    out = fn(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)  # (B, H, S, D)
    return out.transpose(1, 2).contiguous()


def _flash_varlen_runs(query: torch.Tensor, dropout: float) -> bool:
    """Flash varlen takes bf16/fp16 CUDA tensors and no dropout."""
    return query.is_cuda and query.dtype in _HALF and not dropout


def _varlen(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sequences: VarlenSequences,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    rows, heads, width, dim = query.shape
    if _flash_varlen_runs(query, dropout):
        from torch.nn.attention.varlen import varlen_attn

        def flat(x: torch.Tensor) -> torch.Tensor:  # (R, H, W, D) -> (R·W, H, D)
            return x.transpose(1, 2).reshape(rows * width, x.shape[1], dim)

        n = sequences.max_seqlen
        out = varlen_attn(
            flat(query), flat(key), flat(value), sequences.cu_seqlens, sequences.cu_seqlens, n, n,
            scale=scaling, enable_gqa=key.shape[1] != heads, window_size=(-1, 0),  # (-1, 0): causal
        )  # (R·W, H, D)
        return out.view(rows, width, heads, dim), None
    # No flash varlen here (CPU, float32, dropout): on CUDA flex with the document mask (block-sparse,
    # like varlen), elsewhere sdpa with the dense block-diagonal mask.
    use_flex = query.is_cuda and not dropout
    reason = f"{query.device.type} {query.dtype}" + (" with dropout" if dropout else "")
    if reason not in _logged:
        _logged.add(reason)
        log.info("varlen attention kernel: no flash varlen for %s; %s.", reason,
                 "flex attention with the document mask" if use_flex else "sdpa with the block-diagonal mask")
    mod = document_causal_mask_mod(sequences.seq_ids)
    if use_flex:
        if "block" not in sequences.cache:
            sequences.cache["block"] = block_mask(mod, rows, width, query.device)
        return _flex(query, key, value, sequences.cache["block"], scaling), None
    if "dense" not in sequences.cache:
        sequences.cache["dense"] = dense_mask(mod, rows, width, query.device)
    return _original_sdpa(module, query, key, value, sequences.cache["dense"], dropout=dropout, scaling=scaling,
                          **kwargs)

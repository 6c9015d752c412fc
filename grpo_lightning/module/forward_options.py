"""``ForwardOptions``: which log-prob forward path the module uses (see ``module/forward.py``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardOptions:
    """How the policy/reference forward computes completion log-probs.

    Args:
        chunked_lm_head: Compute log-probs and entropies from the final hidden states, running the
            LM head on the real completion tokens only, ``lm_head_chunk_tokens`` at a time, and
            recompute each chunk's logits in backward (an analytic backward for ``nn.Linear``
            heads): never holds ``(B, T, V)`` fp32 logits. Same values and gradients as the plain
            path; peak memory of the head drops from ``O(B·T·V)`` to ``O(chunk·V)`` for one extra
            head matmul per chunk in backward, which the fused backward's fewer passes over the
            logits repay (measured faster than the plain path on CPU and GPU). ``False`` with
            ``padding_free`` keeps every chunk's logits for backward (the plain memory profile).
        lm_head_chunk_tokens: Tokens per LM-head chunk: the head's transient memory is about
            three ``chunk × V`` fp32 buffers (1024 × 151,936 → ~1.9 GB). ``"auto"``: on CUDA the
            fastest of 1K-16K tokens measured once on the real head (within a quarter of the
            free memory, :mod:`grpo_lightning.module.lm_head_calibration`), 1024 on CPU.
        padding_free: Pack the real tokens of every row end to end (position ids restart per
            sequence, no attention mask) so that no compute goes to padding. Needs an attention
            implementation that isolates packed sequences (``sdpa``, ``eager``, ``flex_attention``,
            ``flash_attention_2/3``); falls back to the padded batch otherwise.
        packed_row_tokens: For mask-based attention (``sdpa``/``eager``), sequences are packed
            first-fit-decreasing into rows of at most ``max(packed_row_tokens, longest
            sequence)`` tokens (``None``: the longest sequence), which keeps the attention cost
            near the padded batch's. Varlen kernels (flash, flex) always take one packed row.
        share_prompt_prefix: With ``padding_free`` and mask-based attention (``sdpa``/``eager``),
            rows whose real prompt tokens are identical (GRPO's ``num_generations`` samples of a
            prompt in one micro-batch) share one copy of the prompt in the packed row, followed by
            each of their completions, isolated by a 4-D attention mask: each prompt is forwarded
            once instead of once per row. Same values and gradients as the plain path. Only used
            when a prompt repeats in the batch and the wider rows' dense attention costs less
            than the prompt tokens saved (an estimate from the model config); varlen kernels
            (flash, flex), and models with a sliding window shorter than a prompt plus its
            completions, keep the unshared packing.
        logprob_token_budget: When set, no-grad passes (old/reference log-probs) run in groups
            of at most this many tokens (padded ``rows × width``, or real tokens when
            ``padding_free``), longest rows first and trimmed of padding, instead of one group
            of the rows given. ``None`` keeps the rows given.
        attention_kernel: Attention kernel of the packed and prompt-shared forwards under
            ``sdpa``: ``sdpa_mask`` (a materialised mask, no flash kernel), ``flex`` (flex
            attention with a block mask, compiled on CUDA; no CPU backward), ``varlen`` (torch's
            flash varlen kernel over the packed sequences, bf16/fp16 CUDA; a shared prompt takes
            ``flex``), ``auto`` (``varlen``/``flex`` on CUDA, ``sdpa_mask`` elsewhere). With
            ``flex``/``varlen`` sequences go into one packed row. The default is ``auto``
            (CPU behaviour is ``sdpa_mask``): on an H200 the kernels matched the plain path in
            values and gradients, and the packed flex pass was 33 % faster than ``sdpa_mask``.
            See docs/gpu.md.
        train_token_budget: When set, each training micro-batch is scored in parts of at most
            this many tokens (sized as for ``logprob_token_budget``), one forward+backward per
            part, so the activation memory follows the budget instead of the micro-batch's row
            count. Every normaliser still uses the whole micro-batch's rows and tokens, so the
            gradient and the logged metrics equal the one-pass step. ``None``: one pass.
    """

    chunked_lm_head: bool = True
    lm_head_chunk_tokens: int | str = 1024
    padding_free: bool = True
    packed_row_tokens: int | None = None
    share_prompt_prefix: bool = True
    logprob_token_budget: int | None = None
    train_token_budget: int | None = None
    attention_kernel: str = "auto"

    def __post_init__(self) -> None:
        chunk = self.lm_head_chunk_tokens
        if chunk != "auto" and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ValueError(f"forward.lm_head_chunk_tokens={chunk!r}: use a token count >= 1 or 'auto'.")
        kernels = ("auto", "sdpa_mask", "flex", "varlen")
        if self.attention_kernel not in kernels:
            raise ValueError(f"forward.attention_kernel={self.attention_kernel!r}: use one of {', '.join(kernels)}.")
        if self.packed_row_tokens is not None and self.packed_row_tokens < 1:
            raise ValueError(
                f"forward.packed_row_tokens={self.packed_row_tokens}: use a positive token count or null."
            )
        for name in ("logprob_token_budget", "train_token_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"forward.{name}={value}: use a positive token count or null.")

    @classmethod
    def plain(cls) -> "ForwardOptions":
        """The plain path: padded batch, full logits from the model (TRL's forward)."""
        return cls(chunked_lm_head=False, padding_free=False, share_prompt_prefix=False)

    def under_sharding(self, strategy: str) -> "ForwardOptions":
        """These options for a policy sharded by FSDP1 (``strategy`` names it in the log): the plain
        path. The optimized paths read the LM head's weight themselves, and FSDP1's flat parameters
        are not known to be whole there. (FSDP2 and ZeRO-3 keep the optimized paths: they run
        through the modules' hooks, ``module/sharding.py``.)"""
        if not (self.chunked_lm_head or self.padding_free):
            return self
        log.info("%s: model.forward uses the plain path (full forward, no chunked LM head/packing).", strategy)
        return replace(self, chunked_lm_head=False, padding_free=False, share_prompt_prefix=False)

    def check_strategy(self, strategy: str) -> None:
        """Refuse what a Lightning strategy (by class name) cannot run."""
        if self.train_token_budget is not None and "DeepSpeed" in strategy:
            raise ValueError(
                "model.forward.train_token_budget backpropagates parts of a micro-batch inside training_step, "
                f"which {strategy} does not support (it counts one backward per micro-step): set it to null."
            )


# GRPOModule keeps its ``forward`` argument in the checkpoint's hyper-parameters; let
# ``torch.load(weights_only=True)`` (Lightning's resume) rebuild it.
torch.serialization.add_safe_globals([ForwardOptions])

"""The policy's scoring of one micro-batch for its loss: log-probs, entropies, the top-entropy mask
and the MoE router loss, and the router term's addition to the loss (``GRPOModule._policy_loss``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from grpo_lightning.algo.distributed_quantile import AllReduce
from grpo_lightning.losses import LossInputs, LossOutput, MicroBatchTotals, top_entropy_mask
from grpo_lightning.module.forward import completion_logprobs
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.module.moe_aux import completion_logprobs_and_router_aux
from grpo_lightning.types import MetricValue, RolloutBatch


@dataclass(frozen=True)
class LossTerms:
    """The selection and auxiliary terms of the training loss (resolved ``GRPOModule`` settings).

    Attributes:
        top_entropy_quantile: ``ρ``; below 1 only the top-``ρ`` entropy tokens enter the policy term.
        router_aux_loss_coef: Weight of the MoE load-balancing loss; 0 = not computed.
    """

    top_entropy_quantile: float = 1.0
    router_aux_loss_coef: float = 0.0


@dataclass
class ScoredBatch:
    """What the policy's forward gives the loss: ``(B, T)`` log-probs and entropies, the ``(B, T)``
    top-entropy mask (``None``: every token) and the router loss (``None``: not a MoE term)."""

    logps: torch.Tensor
    entropies: torch.Tensor | None
    entropy_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def score_batch(
    policy: torch.nn.Module,
    batch: RolloutBatch,
    options: ForwardOptions,
    terms: LossTerms,
    *,
    entropy_requires_grad: bool,
    all_reduce: AllReduce | None,
) -> ScoredBatch:
    """Forward ``batch`` through ``policy``; with ``top_entropy_quantile < 1`` every rank must call
    it together (the threshold is a quantile over all ranks' active tokens)."""
    args = (policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
            batch.temperature)
    aux = None
    if terms.router_aux_loss_coef != 0.0 and batch.model_inputs is not None:
        raise ValueError("router_aux_loss_coef with image inputs is not supported: set it to 0 for this model.")
    if terms.router_aux_loss_coef != 0.0:
        logps, entropies, aux = completion_logprobs_and_router_aux(
            *args, entropy_requires_grad=entropy_requires_grad, options=options
        )
    else:
        logps, entropies = completion_logprobs(*args, entropy_requires_grad=entropy_requires_grad, options=options,
                                               model_inputs=batch.model_inputs)  # images: per-row pixel inputs
    entropy_mask = None
    if terms.top_entropy_quantile < 1.0 and entropies is not None:
        entropy_mask = top_entropy_mask(entropies, batch.loss_mask, terms.top_entropy_quantile, all_reduce=all_reduce)
    return ScoredBatch(logps, entropies, entropy_mask, aux)


def loss_inputs(
    batch: RolloutBatch,
    scored: ScoredBatch,
    world_size: int,
    accumulation_steps: float,
    entropy_coef: float,
    totals: MicroBatchTotals | None,
) -> LossInputs:
    """The loss's inputs for ``batch`` scored as ``scored``."""
    return LossInputs(
        logps=scored.logps,
        old_logps=batch.old_logps,
        advantages=batch.advantages,
        mask=batch.loss_mask,
        ref_logps=batch.ref_logps,
        sampling_logps=batch.sampling_logps,
        sampling_is_weights=batch.sampling_is_weights,
        entropies=scored.entropies,
        num_items_in_batch=batch.num_items_in_batch,
        max_completion_length=batch.max_completion_length,
        num_processes=world_size,
        gradient_accumulation_steps=accumulation_steps,
        entropy_coef=entropy_coef,
        entropy_mask=scored.entropy_mask,
        totals=totals,
    )


def add_router_aux_loss(
    out: LossOutput, aux_loss: torch.Tensor | None, coef: float, accumulation_steps: float, share: float = 1.0
) -> LossOutput:
    """``loss + coef · aux / GA`` and the ``aux_loss`` metric (the mean over ranks and micro-steps).

    A part of a micro-batch (token-budget training) adds its own router loss weighted by its
    ``share`` of the micro-batch's rows, so the parts add up to the row-weighted mean of theirs
    (TRL likewise averages the router losses of its forward chunks).
    """
    if aux_loss is None:
        return out
    loss = out.loss + coef * aux_loss * share / accumulation_steps
    detached = aux_loss.detach().float()
    metrics = {**out.metrics, "aux_loss": MetricValue(detached * share, torch.tensor(share, device=detached.device))}
    return LossOutput(loss=loss, metrics=metrics)


def rows_logprobs(
    model: torch.nn.Module,
    batch: RolloutBatch,
    chunk_size: int,
    options: ForwardOptions,
    precision_context: Callable[[], ContextManager[None]],
    logprobs_of: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = completion_logprobs,
) -> torch.Tensor:
    """Completion log-probs of ``batch`` under ``model``, ``chunk_size`` rows per forward (one
    group when ``options.logprob_token_budget`` groups rows by tokens itself), ``(B, T)``;
    ``logprobs_of`` is :func:`~grpo_lightning.module.forward.completion_logprobs` or a stand-in."""
    if options.logprob_token_budget is not None:
        chunk_size = len(batch)
    chunks = []
    for start in range(0, len(batch), chunk_size):
        rows = slice(start, start + chunk_size)
        with precision_context():  # the numerics of the training forward
            logps, _ = logprobs_of(
                model, batch.prompt_ids[rows], batch.prompt_mask[rows], batch.completion_ids[rows],
                batch.completion_mask[rows], batch.temperature, with_entropy=False, options=options,
                **({} if batch.model_inputs is None else {"model_inputs": batch.model_inputs.select(range(len(batch))[rows])}),
            )
        chunks.append(logps)
    return torch.cat(chunks)

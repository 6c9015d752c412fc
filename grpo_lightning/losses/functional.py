"""Functional entry point: plain tensors in, ``(loss, metrics)`` out, no model needed."""

from __future__ import annotations

import inspect

import torch

from grpo_lightning.losses.records import LossInputs
from grpo_lightning.losses.registry import LOSSES, get_loss


def policy_loss(
    loss_type: str,
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    sampling_is_weights: torch.Tensor | None = None,
    off_policy_mask_threshold: float | None = None,
    sampling_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
    num_items_in_batch: torch.Tensor | float | None = None,
    max_completion_length: int | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int | float = 1,
    entropies: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's GRPO loss for one micro-step, computed by the registered loss class.

    Shapes: ``logps, old_logps, ref_logps, sampling_logps, mask, entropies`` are ``(B, T)``,
    ``advantages`` ``(B,)``, ``sampling_is_weights`` ``(B, T)`` or ``(B, 1)``. The arguments mean
    what the :class:`~grpo_lightning.losses.base.LossInputs` fields and the loss constructors say;
    knobs a loss type does not use are ignored.

    Returns:
        The loss exactly as TRL's ``_compute_loss`` returns it to backward, and the local (this
        process only) values of the metrics the loss logs.

    >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> loss, m = policy_loss("grpo", lp, None, torch.tensor([1.0]), torch.ones(1, 2))
    >>> loss.item(), m["clip_ratio/region_mean"]
    (-1.0, 0.0)
    """
    cls = LOSSES.get(loss_type) if isinstance(loss_type, str) else None
    settings = dict(
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        delta=delta,
        beta=beta,
        importance_sampling_level=importance_sampling_level,
        use_bias_correction_kl=use_bias_correction_kl,
        off_policy_mask_threshold=off_policy_mask_threshold,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
    )
    if cls is not None:  # pass only the knobs this class's constructor takes
        accepted = inspect.signature(cls.__init__).parameters
        settings = {k: v for k, v in settings.items() if k in accepted}
    loss_fn = get_loss(loss_type, **settings)  # unknown names raise here with the valid list
    output = loss_fn(
        LossInputs(
            logps=logps,
            old_logps=old_logps,
            advantages=advantages,
            mask=mask,
            ref_logps=ref_logps,
            sampling_logps=sampling_logps,
            sampling_is_weights=sampling_is_weights,
            entropies=entropies,
            num_items_in_batch=num_items_in_batch,
            max_completion_length=max_completion_length,
            num_processes=num_processes,
            gradient_accumulation_steps=gradient_accumulation_steps,
            entropy_coef=entropy_coef,
        )
    )
    return output.loss, {name: value.local() for name, value in output.metrics.items()}

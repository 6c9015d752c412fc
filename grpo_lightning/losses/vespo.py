"""VESPO: variational sequence-level soft policy optimisation (spec §3.5)."""

from __future__ import annotations

import math

import torch

from grpo_lightning.losses.base import PolicyLoss, check_number
from grpo_lightning.losses.metrics import mean_metric
from grpo_lightning.losses.normalizers import global_token_mean
from grpo_lightning.losses.records import LossInputs, LossState, TokenLoss

LOG_MIN_WEIGHT = math.log(1e-8)  # ≈ −18.42: lower clamp of the log sequence weight
LOG_MAX_WEIGHT = 20.0


@torch.no_grad()
def gamma_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    sampling_is_weights: torch.Tensor | None,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> torch.Tensor:
    """VESPO's detached sequence weight ``φ(w) = e^λ · w^k · e^{−λ w}`` (so ``φ(1) = 1``), ``(B, 1)``.

    ``log w = Σ_t clamp(Δ_t, −20, 20)·m_t`` (a *sum* of token log-ratios), plus
    ``Σ_t clamp(log ρ_t, log 1e-8, 20)`` over all positions when a sampler IS weight ``ρ`` is given,
    then clamped to ``[log 1e-8, 20]``. ``(k, λ)`` are the positive pair when ``A ≥ 0``. NaN/inf
    weights become 0.

    >>> a, lr, m = torch.tensor([[1.0]]), torch.zeros(1, 3), torch.ones(1, 3)
    >>> float(gamma_weights(a, lr, m, None, 2.0, 3.0, 3.0, 2.0))
    1.0
    """
    seq_log_ratio = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)  # (B, 1)
    if sampling_is_weights is not None:
        log_is = torch.clamp(torch.log(sampling_is_weights), LOG_MIN_WEIGHT, LOG_MAX_WEIGHT)
        seq_log_ratio = seq_log_ratio + log_is.sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, LOG_MIN_WEIGHT, LOG_MAX_WEIGHT)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


class VESPOLoss(PolicyLoss):
    """VESPO: ``L = −φ(w)·A·ℓ`` with a detached gamma-shaped sequence weight ``φ``.

    ``w`` is the whole-sequence importance ratio (product of token ratios, times the sampler
    correction ``ρ`` when given: ``ρ`` is folded into ``φ`` and not multiplied again).
    Aggregated like ``dapo``: ``Σ L m / (max(N, 1) / P)``, not divided by ``GA``.
    Metric: ``vespo/phi_seq_mean``, the mean of ``φ`` over sequences.

    Args:
        epsilon: Unused by VESPO (kept for a uniform signature).
        epsilon_high: Unused by VESPO.
        delta: Unused by VESPO.
        beta: KL penalty coefficient; 0 disables the reference model.
        importance_sampling_level: Should stay ``"token"`` (φ is sequence-level already; only the
            bias-corrected KL uses this ratio). A warning otherwise.
        use_bias_correction_kl: Multiply the KL term by the importance ratio.
        off_policy_mask_threshold: Off-policy sequence-mask threshold; ``None`` disables.
        vespo_k_pos: Shape ``k`` of φ for ``A ≥ 0``.
        vespo_lambda_pos: Rate ``λ`` of φ for ``A ≥ 0`` (clamped to ≥ 1e-4).
        vespo_k_neg: Shape ``k`` of φ for ``A < 0``.
        vespo_lambda_neg: Rate ``λ`` of φ for ``A < 0`` (clamped to ≥ 1e-4).
    """

    name = "vespo"
    multiplies_is_weight = False
    divides_by_accumulation = False

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        beta: float = 0.0,
        importance_sampling_level: str = "token",
        use_bias_correction_kl: bool = True,
        off_policy_mask_threshold: float | None = None,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
    ) -> None:
        super().__init__(
            epsilon, epsilon_high, delta, beta, importance_sampling_level, use_bias_correction_kl,
            off_policy_mask_threshold,
        )
        for name, value in (
            ("vespo_k_pos", vespo_k_pos),
            ("vespo_lambda_pos", vespo_lambda_pos),
            ("vespo_k_neg", vespo_k_neg),
            ("vespo_lambda_neg", vespo_lambda_neg),
        ):
            check_number(name, value, minimum=0.0)
        self.vespo_k_pos = float(vespo_k_pos)
        self.vespo_lambda_pos = float(vespo_lambda_pos)
        self.vespo_k_neg = float(vespo_k_neg)
        self.vespo_lambda_neg = float(vespo_lambda_neg)

    def per_token_loss(self, state: LossState) -> TokenLoss:
        phi = gamma_weights(
            state.advantages,
            state.log_ratio,
            state.mask,
            state.sampling_is_weights,
            self.vespo_k_pos,
            self.vespo_lambda_pos,
            self.vespo_k_neg,
            self.vespo_lambda_neg,
        )  # (B, 1)
        values = -phi * state.advantages * state.logps  # (B, T)
        return TokenLoss(values, {"vespo/phi_seq_mean": mean_metric(phi, state.mask, per_sequence=True)})

    def normalize(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        return global_token_mean(
            per_token_loss, mask, inputs.num_items_in_batch, inputs.num_processes, inputs.batch_loss_tokens
        )

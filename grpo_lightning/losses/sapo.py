"""SAPO: soft adaptive policy optimisation (spec §3.5): a sigmoid gate instead of a hard clip."""

from __future__ import annotations

import torch

from grpo_lightning.losses.base import PolicyLoss, check_number
from grpo_lightning.losses.normalizers import sequence_mean
from grpo_lightning.losses.records import LossInputs, LossState, TokenLoss


class SAPOLoss(PolicyLoss):
    """SAPO: ``L = −σ(τ (c1 − 1)) · 4/τ · A`` with ``τ`` chosen by the sign of ``A``.

    The gate has slope 1 at ``c1 = 1`` (on-policy it matches the plain policy gradient) and decays
    smoothly off-policy. Aggregated like ``grpo``: ``mean_i [Σ_t L m / max(Σ_t m, 1)] / GA``.
    No per-loss metrics.

    Args:
        epsilon: Unused by SAPO (kept for a uniform signature).
        epsilon_high: Unused by SAPO.
        delta: Unused by SAPO.
        beta: KL penalty coefficient; 0 disables the reference model.
        importance_sampling_level: ``"token"`` or ``"sequence"``.
        use_bias_correction_kl: Multiply the KL term by the importance ratio.
        off_policy_mask_threshold: Off-policy sequence-mask threshold; ``None`` disables.
        sapo_temperature_pos: Gate temperature ``τ`` for tokens with ``A > 0``.
        sapo_temperature_neg: Gate temperature ``τ`` for tokens with ``A ≤ 0``.
    """

    name = "sapo"

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        beta: float = 0.0,
        importance_sampling_level: str = "token",
        use_bias_correction_kl: bool = True,
        off_policy_mask_threshold: float | None = None,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
    ) -> None:
        super().__init__(
            epsilon, epsilon_high, delta, beta, importance_sampling_level, use_bias_correction_kl,
            off_policy_mask_threshold,
        )
        temperatures = {"sapo_temperature_pos": sapo_temperature_pos, "sapo_temperature_neg": sapo_temperature_neg}
        for name, value in temperatures.items():
            check_number(name, value)
            if value <= 0:
                raise ValueError(f"{name}={value}: the gate temperature must be > 0.")
        self.sapo_temperature_pos = float(sapo_temperature_pos)
        self.sapo_temperature_neg = float(sapo_temperature_neg)

    def per_token_loss(self, state: LossState) -> TokenLoss:
        advantages = state.advantages  # (B, 1)
        tau = torch.where(advantages > 0, self.sapo_temperature_pos, self.sapo_temperature_neg)
        gate = torch.sigmoid(tau * (state.ratio - 1)) * 4 / tau  # (B, T)|(B, 1)
        return TokenLoss(-gate * advantages)

    def normalize(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        return sequence_mean(per_token_loss, mask, inputs.batch_rows)

"""CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, spec §3.4)."""

from __future__ import annotations

import torch

from grpo_lightning.losses.base import PolicyLoss
from grpo_lightning.losses.metrics import mean_metric
from grpo_lightning.losses.normalizers import global_token_mean
from grpo_lightning.losses.records import LossInputs, LossState, TokenLoss


class CISPOLoss(PolicyLoss):
    """CISPO: REINFORCE with a detached, upper-capped importance weight.

    ``L = −min(c1, ε_hi).detach() · A · ℓ``: unlike PPO clipping no token loses its gradient,
    the weight is only capped. There is no lower bound. Aggregated like ``dapo``:
    ``Σ L m / (max(N, 1) / P)``, not divided by ``GA``.

    ``ε_hi`` defaults to 5.0, the ScaleRL-recommended cap that TRL's documentation states. This
    deviates from TRL 1.16's code, which falls back to ``epsilon`` (0.2) and so caps every weight
    at 0.2; pass ``epsilon_high=0.2`` (or ``epsilon``) to reproduce that (docs/losses.md).

    Metric: ``cispo_clip_ratio``, the fraction of tokens with ``c1 > ε_hi`` and ``A > 0``.

    Args:
        epsilon: Unused by CISPO (kept for a uniform signature; not the default cap).
        epsilon_high: The cap ``ε_hi`` on the importance weight; ``None`` means 5.0.
        delta: Ignored by CISPO (kept for a uniform signature).
        beta: KL penalty coefficient; 0 disables the reference model.
        importance_sampling_level: ``"token"`` or ``"sequence"``.
        use_bias_correction_kl: Multiply the KL term by the importance ratio.
        off_policy_mask_threshold: Off-policy sequence-mask threshold; ``None`` disables.
    """

    name = "cispo"
    divides_by_accumulation = False
    default_epsilon_high = 5.0  # ScaleRL; TRL 1.16's code uses epsilon (0.2)

    def per_token_loss(self, state: LossState) -> TokenLoss:
        cap = self.epsilon_high_value
        weight = torch.clamp(state.ratio, max=cap).detach()  # (B, T)|(B, 1)
        values = -weight * state.advantages * state.logps  # (B, T)
        with torch.no_grad():
            clipped = ((state.ratio > cap) & (state.advantages > 0)).float()
        ratio_metric = mean_metric(clipped, state.mask, self.per_sequence(clipped))
        return TokenLoss(values, {"cispo_clip_ratio": ratio_metric})

    def normalize(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        return global_token_mean(
            per_token_loss, mask, inputs.num_items_in_batch, inputs.num_processes, inputs.batch_loss_tokens
        )

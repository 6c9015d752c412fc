"""Top-entropy token selection in the module, and the entropy window an entropy controller reads.

``top_entropy_quantile = ρ < 1`` keeps in the policy term only the active tokens whose entropy is
in the top ``ρ`` fraction of the micro-batch, over every rank (spec §3.10). The threshold comes from
the training forward's entropies (detached) and the micro-batch's loss mask, which already excludes
truncated completions under ``mask_truncated_completions``; it is found without gathering the
tokens (:func:`~grpo_lightning.algo.distributed_quantile.distributed_quantile`).

:class:`EntropyWindow` sums ``Σ H·m'`` and ``Σ m'`` (``m' = m·E``, the tokens the policy loss acts
on) over the micro-steps of one optimizer step; :class:`~grpo_lightning.callbacks.AdaptiveEntropy`
attaches one to ``GRPOModule.entropy_window`` and reads the window's world mean at each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
import torch

from grpo_lightning.algo.distributed_quantile import AllReduce
from grpo_lightning.module.forward_options import ForwardOptions


def check_top_entropy_quantile(value: float, forward: ForwardOptions) -> float:
    """``value`` as a float in ``[0, 1]``; refuses it below 1 with ``forward.train_token_budget``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"model.top_entropy_quantile={value!r}: it must be in [0, 1] (1 keeps every token; the paper uses 0.2)."
        )
    if value < 1.0 and forward.train_token_budget is not None:
        raise ValueError(
            f"model.top_entropy_quantile={value} with model.forward.train_token_budget="
            f"{forward.train_token_budget}: the entropy threshold is a quantile over the whole micro-batch, "
            "but a token budget scores it in parts, one backward each. Set model.forward.train_token_budget "
            "to null (or lower data.per_device_train_batch_size), or top_entropy_quantile to 1."
        )
    return float(value)


def world_sum(world_size: int) -> AllReduce | None:
    """A sum over the default process group, or ``None`` on one process.

    ``torch.distributed.all_reduce`` directly: Lightning's ``strategy.reduce`` puts a barrier
    before every call, and the quantile makes 33 of them.
    """
    if world_size <= 1 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        if op != "sum":
            raise ValueError(f"world_sum reduces with 'sum' only, not {op!r}.")
        tensor = tensor.clone()
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    return reduce


def entropy_coef_metrics(entropy_coef: float, controller_coef: float | None) -> dict[str, float]:
    """The step's ``entropy_coef`` metric: a controller's coefficient whenever one is attached,
    else the applied coefficient when the bonus is on (TRL logs it iff the bonus is active)."""
    if controller_coef is not None:
        return {"entropy_coef": float(controller_coef)}
    return {"entropy_coef": float(entropy_coef)} if entropy_coef != 0 else {}


@dataclass
class EntropyWindow:
    """Entropy sum and token count of the policy-loss tokens since the last :meth:`take`.

    Device tensors, added to without host synchronisation; :meth:`take` reduces them over ranks.
    """

    total: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    count: torch.Tensor = field(default_factory=lambda: torch.zeros(()))

    def add(self, entropies: torch.Tensor, mask: torch.Tensor, entropy_mask: torch.Tensor | None = None) -> None:
        """Add one micro-batch (or part): ``(B, T)`` entropies, loss mask and top-entropy mask."""
        tokens = mask.float() if entropy_mask is None else mask.float() * entropy_mask.float()
        total = (entropies.detach().float() * tokens).sum()
        self.total = self.total.to(total.device) + total
        self.count = self.count.to(total.device) + tokens.sum()

    def take(self, all_reduce: AllReduce | None = None) -> tuple[float, float]:
        """``(Σ H·m', Σ m')`` over ranks (collective when ``all_reduce`` is given), then reset."""
        stats = torch.stack([self.total.float(), self.count.float()])
        if all_reduce is not None:
            stats = all_reduce(stats, "sum")
        self.total, self.count = torch.zeros(()), torch.zeros(())
        total, count = stats.tolist()
        return total, count

    @staticmethod
    def mean(total: float, count: float) -> float:
        """The token mean, NaN when there is no token."""
        return total / count if count > 0 else math.nan


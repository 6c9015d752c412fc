"""``AdaptiveEntropy``: the entropy-bonus coefficient steered toward a target entropy (Skywork-OR1).

TRL's ``use_adaptive_entropy`` (spec §3.11), as a callback on ``GRPOModule.entropy_coef``:

* the module's ``entropy_coef`` (``model.entropy_coef`` in YAML) is the initial coefficient ``c``;
* at the end of each optimizer step, ``H`` = the token mean of the entropies of every token the
  policy loss acted on in that step (all micro-steps, all ranks; only the top-entropy tokens
  under ``top_entropy_quantile < 1``); then ``c ← min(c + δ, c_max)`` if ``H ≤ target`` else
  ``c ← max(c − δ, c_min)``;
* the next step applies ``c`` if that ``H ≤ target``, else 0: the bonus acts only once entropy has
  fallen to the target, and never in the first step (no entropy measured yet);
* ``entropy_coef`` is logged every optimizer step (``c`` after the update, even while the bonus
  is gated off), and ``c`` and the last ``H`` are saved in checkpoints.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch

from grpo_lightning.module.entropy_selection import EntropyWindow, world_sum


def next_coefficient(coef: float, entropy: float, target: float, delta: float, low: float, high: float) -> float:
    """One controller step: ``c + δ`` (at most ``high``) when ``entropy ≤ target``, else ``c − δ``
    (at least ``low``).

    >>> next_coefficient(0.01, 1.0, 2.0, 0.005, 0.0, 1.0), next_coefficient(0.003, 3.0, 2.0, 0.005, 0.0, 1.0)
    (0.015, 0.0)
    """
    if entropy <= target:
        return min(coef + delta, high)
    return max(coef - delta, low)


def at_optimizer_step_boundary(trainer: Any) -> bool:
    """Whether ``on_before_optimizer_step`` is at a real optimizer step. Lightning calls it once
    per step, except under a strategy that accumulates gradients itself (DeepSpeed calls it every
    micro-step): there the engine says whether this micro-step ends its accumulation window."""
    strategy = getattr(trainer, "strategy", None)
    if not getattr(strategy, "handles_gradient_accumulation", False):
        return True
    boundary = getattr(getattr(strategy, "model", None), "is_gradient_accumulation_boundary", None)
    return bool(boundary()) if callable(boundary) else True


class AdaptiveEntropy(pl.Callback):
    """Adapts ``GRPOModule.entropy_coef`` each optimizer step toward a target entropy (TRL's
    ``use_adaptive_entropy``); its initial value is ``model.entropy_coef``.

    Args:
        entropy_target: Target mean per-token entropy in nats. The coefficient grows by
            ``entropy_coef_delta`` after a step whose entropy is at or below it and shrinks
            otherwise, and the bonus applies only after such a step. Measured on the tokens of
            the policy loss (the top-entropy subset under ``model.top_entropy_quantile < 1``,
            higher than the logged ``entropy``). The default 0.2 almost never triggers for
            language models (2–10 nats per token): set it near the ``entropy`` of early training.
        entropy_coef_delta: Step of the coefficient per optimizer step.
        entropy_coef_min: Lower bound of the coefficient.
        entropy_coef_max: Upper bound of the coefficient.

    Attributes:
        entropy_coef: The controller's coefficient (``None`` before training starts).
        last_world_entropy: The entropy measured at the last optimizer step (``inf`` before one).
    """

    def __init__(
        self,
        entropy_target: float = 0.2,
        entropy_coef_delta: float = 0.005,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
    ) -> None:
        for name, value in [("entropy_target", entropy_target), ("entropy_coef_delta", entropy_coef_delta),
                            ("entropy_coef_min", entropy_coef_min), ("entropy_coef_max", entropy_coef_max)]:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"AdaptiveEntropy {name}={value!r}: expected a finite number.")
        if entropy_coef_delta < 0:
            raise ValueError(f"AdaptiveEntropy entropy_coef_delta={entropy_coef_delta}: it must be >= 0.")
        if entropy_coef_min > entropy_coef_max:
            raise ValueError(
                f"AdaptiveEntropy entropy_coef_min={entropy_coef_min} > entropy_coef_max={entropy_coef_max}: "
                "the bounds are reversed."
            )
        self.entropy_target = float(entropy_target)
        self.entropy_coef_delta = float(entropy_coef_delta)
        self.entropy_coef_min = float(entropy_coef_min)
        self.entropy_coef_max = float(entropy_coef_max)
        self.entropy_coef: float | None = None
        self.last_world_entropy = math.inf

    # ------------------------------------------------------------------ the controller
    @property
    def applied_coef(self) -> float:
        """The coefficient the next optimizer step trains with: ``entropy_coef`` once the last
        measured entropy is at or below the target, else 0."""
        if self.entropy_coef is None or not self.last_world_entropy <= self.entropy_target:
            return 0.0
        return self.entropy_coef

    def update(self, entropy: float) -> None:
        """One optimizer step's update from its measured ``entropy`` (NaN: no token, no update)."""
        if self.entropy_coef is None:
            raise RuntimeError("AdaptiveEntropy.update before training started: the initial coefficient is unknown.")
        if math.isnan(entropy):  # nothing was measured (every token masked): keep the state
            return
        self.entropy_coef = next_coefficient(self.entropy_coef, entropy, self.entropy_target, self.entropy_coef_delta,
                                             self.entropy_coef_min, self.entropy_coef_max)
        self.last_world_entropy = entropy

    def _apply(self, pl_module: Any) -> None:
        pl_module.entropy_coef = self.applied_coef
        pl_module.entropy_coef_metric = float(self.entropy_coef)  # logged with this step's metrics

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "entropy_coef") or not hasattr(pl_module, "entropy_window"):
            raise TypeError(
                f"AdaptiveEntropy adapts GRPOModule.entropy_coef; {type(pl_module).__name__} has no entropy_coef "
                "and entropy_window: use it with grpo_lightning's GRPOModule."
            )
        if stage == "fit":
            pl_module.entropy_window = EntropyWindow()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.entropy_coef is None:  # a fresh run (a resumed one restored it from the checkpoint)
            self.entropy_coef = float(pl_module.entropy_coef)
        pl_module.entropy_window = EntropyWindow()
        self._apply(pl_module)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Every micro-step of this optimizer step has run its forward: the window is complete.
        # Runs before the module publishes the step's metrics, so ``entropy_coef`` is the new value.
        if not at_optimizer_step_boundary(trainer):
            return
        total, count = pl_module.entropy_window.take(world_sum(trainer.world_size))
        self.update(EntropyWindow.mean(total, count))
        self._apply(pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            pl_module.entropy_window = None
            pl_module.entropy_coef_metric = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"entropy_coef": self.entropy_coef, "last_world_entropy": self.last_world_entropy}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.entropy_coef = state_dict["entropy_coef"]
        self.last_world_entropy = float(state_dict["last_world_entropy"])

"""Calling reward functions with TRL's convention and checking what they return (spec §5.2).

Layer L1: pure python/torch, no lightning.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from grpo_lightning.rewards.loading import RewardFunction
from grpo_lightning.rewards.reward_model import RewardModel
from grpo_lightning.utils import async_loop

logger = logging.getLogger(__name__)

# Columns TRL never forwards (GT `_calculate_rewards`), and keyword names the runner itself passes.
EXCLUDED_COLUMNS = ("prompt", "completion", "completion_ids")
RESERVED_KWARGS = (
    "prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
    "environments",
)  # fmt: skip


@dataclass
class RewardScores:
    """The rewards of one scoring call.

    Attributes:
        rewards: ``(B, F)`` float32, one column per reward function; ``None`` returns are NaN.
        names: The ``F`` reward function names, in column order.
        logged_metrics: Values pushed through ``log_metric(name, value)``, per name, in call order.
        extra_columns: Values pushed through ``log_extra(column, values)`` (completions table only).
    """

    rewards: torch.Tensor
    names: list[str]
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)


class RewardRunner:
    """Runs reward functions over a batch of completions: sync ones (and reward models) in order,
    then async ones concurrently on a background event loop.

    Args:
        funcs: The resolved reward functions (see ``resolve_reward_funcs``).
        weights: One weight per function (``data.reward_weights``); ``None`` means all ones.
        chat_template_kwargs: The run's ``chat_template_kwargs``, used by reward models that have
            none of their own to render conversational prompts.
    """

    def __init__(
        self,
        funcs: Sequence[RewardFunction],
        weights: Sequence[float] | None = None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        if not funcs:
            raise ValueError(
                "no reward functions: set data.reward_funcs to at least one built-in name or "
                "dotted path 'package.module.function'."
            )
        self.funcs = list(funcs)
        if weights is None:
            weights = [1.0] * len(self.funcs)
        weights = list(weights)
        if len(weights) != len(self.funcs):
            raise ValueError(
                f"data.reward_weights has {len(weights)} values but there are {len(self.funcs)} "
                f"reward functions ({', '.join(self.names)}): give exactly one weight per reward "
                "function, in the same order, or leave data.reward_weights unset (all 1.0)."
            )
        bad = [w for w in weights if not _is_number(w) or not math.isfinite(float(w))]
        if bad:
            raise ValueError(f"data.reward_weights must be finite numbers; got {bad!r}.")
        self._weights = torch.tensor([float(w) for w in weights], dtype=torch.float32)
        for model in self.reward_models:
            if model.chat_template_kwargs is None:
                model.chat_template_kwargs = dict(chat_template_kwargs or {})

    @property
    def reward_models(self) -> list[RewardModel]:
        """The reward functions that are :class:`RewardModel` s, in column order."""
        return [f.func for f in self.funcs if isinstance(f.func, RewardModel)]

    def to(self, device: torch.device | str) -> "RewardRunner":
        """Move every reward model to ``device`` (the training device); functions are untouched.

        Args:
            device: Target device, e.g. ``trainer.strategy.root_device``.

        Returns:
            This runner.
        """
        for model in self.reward_models:
            model.to(device)
        return self

    @property
    def names(self) -> list[str]:
        """Reward function names, in column order."""
        return [f.name for f in self.funcs]

    @property
    def weights(self) -> torch.Tensor:
        """``(F,)`` float32 reward weights for the advantage computation."""
        return self._weights.clone()

    def score(
        self,
        *,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: dict[str, Sequence[Any]] | None = None,
        trainer_state: Any = None,
        environments: Sequence[Any] | None = None,
    ) -> RewardScores:
        """Score ``B`` completions with every reward function.

        Args:
            prompts: ``B`` prompt objects (strings or message lists), one per completion.
            completions: ``B`` decoded completions (strings or assistant message lists).
            completion_ids: ``B`` unpadded completion token lists.
            columns: Other dataset columns, each a list of ``B`` values; ``prompt``,
                ``completion`` and ``completion_ids`` are dropped, like TRL.
            trainer_state: Passed through as ``trainer_state`` (for reward shaping by progress).
            environments: Per-completion environment instances; passed only when not ``None``.

        Returns:
            The ``(B, F)`` reward matrix plus everything logged through ``log_metric``/``log_extra``.

        Raises:
            ValueError: On inconsistent input lengths or a reward function returning the wrong
                length or a non-number.
            TypeError: When a reward function returns something that is not a sequence.
        """
        n = len(prompts)
        kwargs = self._build_kwargs(prompts, completions, completion_ids, columns or {})
        metrics: dict[str, list[float]] = {}
        extras: dict[str, list[Any]] = {}

        def log_metric(name: str, value: float) -> None:
            metrics.setdefault(str(name), []).append(float(value))

        def log_extra(column: str, values: Sequence[Any]) -> None:
            extras.setdefault(str(column), []).extend(list(values))

        kwargs.update(trainer_state=trainer_state, log_extra=log_extra, log_metric=log_metric)
        if environments is not None:
            kwargs["environments"] = environments

        rewards = torch.full((n, len(self.funcs)), float("nan"), dtype=torch.float32)
        async_items: list[tuple[int, RewardFunction]] = []
        for col, rf in enumerate(self.funcs):
            if rf.is_async:
                async_items.append((col, rf))
                continue
            output = _call_with_context(rf, kwargs)
            if inspect.isawaitable(output):
                if inspect.iscoroutine(output):
                    output.close()
                raise TypeError(
                    f"reward function '{rf.name}' returned an awaitable but is not declared "
                    "`async def`; declare the function (or its __call__) `async def`."
                )
            rewards[:, col] = _to_column(rf.name, output, n, is_model=isinstance(rf.func, RewardModel))

        if async_items:

            async def _one(rf: RewardFunction) -> Any:
                try:
                    return await rf.func(**kwargs)
                except Exception as err:
                    _add_note(err, rf.name)
                    raise

            outputs = async_loop.gather(_one(rf) for _, rf in async_items)
            for (col, rf), output in zip(async_items, outputs):
                rewards[:, col] = _to_column(rf.name, output, n)

        self._warn_all_nan(rewards, prompts, completions)
        return RewardScores(rewards, self.names, metrics, extras)

    def _build_kwargs(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: dict[str, Sequence[Any]],
    ) -> dict[str, Any]:
        n = len(prompts)
        for label, values in (("completions", completions), ("completion_ids", completion_ids)):
            if len(values) != n:
                raise ValueError(f"got {n} prompts but {len(values)} {label}; they must match.")
        kwargs: dict[str, Any] = {
            "prompts": list(prompts),
            "completions": list(completions),
            "completion_ids": [list(ids) for ids in completion_ids],
        }
        for name, values in columns.items():
            if name in EXCLUDED_COLUMNS:
                continue
            if name in RESERVED_KWARGS:
                raise ValueError(
                    f"dataset column '{name}' clashes with the reward keyword argument of the same "
                    "name; rename that column in the dataset."
                )
            if len(values) != n:
                raise ValueError(f"column '{name}' has {len(values)} values for {n} completions.")
            kwargs[name] = list(values)
        return kwargs

    @staticmethod
    def _warn_all_nan(rewards: torch.Tensor, prompts: Sequence[Any], completions: Sequence[Any]):
        all_nan = torch.isnan(rewards).all(dim=1)
        if bool(all_nan.any()):
            row = int(all_nan.nonzero()[0, 0])
            logger.warning(
                "All reward functions returned None for row %d (%d of %d rows have no reward): "
                "prompt=%r completion=%r. Such rows get no reward signal; make sure at least one "
                "reward function scores every completion.",
                row, int(all_nan.sum()), len(all_nan), prompts[row], completions[row],
            )  # fmt: skip


def _call_with_context(rf: RewardFunction, kwargs: dict[str, Any]) -> Any:
    try:
        return rf.func(**kwargs)
    except Exception as err:
        _add_note(err, rf.name)
        raise


def _add_note(err: BaseException, name: str) -> None:
    if hasattr(err, "add_note"):
        err.add_note(f"(raised by reward function '{name}')")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)


def _to_column(name: str, output: Any, n: int, is_model: bool = False) -> torch.Tensor:
    """Check one reward function's return value and convert it to a ``(n,)`` float32 column.

    ``None`` becomes NaN ("not applicable"); a NaN or infinite return is an error, never a silent
    "not applicable" or an infinite advantage.
    """
    if isinstance(output, torch.Tensor):
        if output.dim() != 1:
            raise ValueError(
                f"reward function '{name}' returned a tensor of shape {tuple(output.shape)}; "
                f"it must be 1-D with one value per completion ({n})."
            )
        output = output.detach().cpu().tolist()
    elif type(output).__module__ == "numpy" and hasattr(output, "ndim"):
        if output.ndim != 1:
            raise ValueError(
                f"reward function '{name}' returned an array of shape {output.shape}; "
                f"it must be 1-D with one value per completion ({n})."
            )
        output = output.tolist()
    elif not isinstance(output, (list, tuple)):
        raise TypeError(
            f"reward function '{name}' returned {type(output).__name__}; it must return a list "
            f"with one float (or None) per completion ({n} completions)."
        )
    if len(output) != n:
        raise ValueError(
            f"reward function '{name}' returned {len(output)} values for {n} completions; it must "
            "return exactly one reward (float, or None when not applicable) per completion."
        )
    values = []
    for i, value in enumerate(output):
        if value is None:
            values.append(float("nan"))
        elif isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            values.append(float(value.item()))
        elif isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
            values.append(float(value))
        else:
            raise ValueError(
                f"reward function '{name}' returned {value!r} ({type(value).__name__}) at index "
                f"{i}; each reward must be a real number, or None when it does not apply."
            )
        if value is not None:
            _check_finite(name, i, values[-1], is_model)
    return torch.tensor(values, dtype=torch.float32)


def _check_finite(name: str, row: int, value: float, is_model: bool) -> None:
    """Rewards are kept in float32: NaN, ±inf and values beyond its range are errors."""
    if math.isfinite(value) and abs(value) <= _FLOAT32_MAX:
        return
    problem = f"{value!r}" if not math.isfinite(value) else f"{value!r}, beyond the float32 range (±3.4e38)"
    if is_model:
        raise ValueError(
            f"reward model '{name}' scored row {row} as {problem}: its logits are not finite. Check "
            "the model's weights and dtype (fp16 overflows easily; try model_init_kwargs: {dtype: "
            "float32} or bfloat16)."
        )
    raise ValueError(
        f"reward function '{name}' returned {problem} for row {row}: rewards must be finite "
        "numbers. Return None (not NaN) for a completion the reward does not apply to, and clip "
        "or rescale unbounded scores."
    )


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

"""Calling reward functions with TRL's convention and checking what they return (spec §5.2).

Layer L1: pure python/torch, no lightning.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from grpo_lightning.rewards.loading import RewardFunction
from grpo_lightning.rewards.returns import is_number, to_column
from grpo_lightning.rewards.reward_model import RewardModel
from grpo_lightning.rewards.timeouts import (
    TIMED_OUT, BackgroundCaller, async_deadline, await_with_timeout, resolve_timeouts, timeout_warning,
)
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
        timed_out: Per function, whether its call ran past its limit (its column is then all NaN
            and it pushed nothing); empty when no call timed out or nothing was scored.
    """

    rewards: torch.Tensor
    names: list[str]
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    timed_out: list[bool] = field(default_factory=list)


class RewardRunner:
    """Runs reward functions over a batch of completions: sync ones (and reward models) in order,
    then async ones concurrently on a background event loop, each within its time limit.

    Args:
        funcs: The resolved reward functions (see ``resolve_reward_funcs``).
        weights: One weight per function (``data.reward_weights``); ``None`` means all ones.
        chat_template_kwargs: The run's ``chat_template_kwargs``, used by reward models that have
            none of their own to render conversational prompts.
        timeout_s: ``data.reward_timeout_s``: seconds a call of each function may take, or
            ``{name: seconds}`` for some functions; a late call scores ``None`` for its
            completions (see ``grpo_lightning.rewards.timeouts``). ``None``: no limit.
    """

    def __init__(
        self,
        funcs: Sequence[RewardFunction],
        weights: Sequence[float] | None = None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float | Mapping[str, float | None] | None = None,
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
        bad = [w for w in weights if not is_number(w) or not math.isfinite(float(w))]
        if bad:
            raise ValueError(f"data.reward_weights must be finite numbers; got {bad!r}.")
        self._weights = torch.tensor([float(w) for w in weights], dtype=torch.float32)
        self.timeouts = resolve_timeouts(timeout_s, self.names)
        self._callers = [
            BackgroundCaller(f.name, t) if t is not None and not f.is_async else None
            for f, t in zip(self.funcs, self.timeouts)
        ]
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
        kwargs["trainer_state"] = trainer_state
        if environments is not None:
            kwargs["environments"] = environments
        # Each call logs into its own buffers, kept only if it returned in time: a timed-out call
        # still running in the background can never add metric names after they were gathered.
        logs = [_CallLog() for _ in self.funcs]
        rewards = torch.full((n, len(self.funcs)), float("nan"), dtype=torch.float32)
        timed_out = [False] * len(self.funcs)
        async_cols: list[int] = []
        for col, rf in enumerate(self.funcs):
            if rf.is_async:
                async_cols.append(col)
                continue
            call = functools.partial(_call_with_context, rf, logs[col].kwargs(kwargs))
            caller = self._callers[col]
            output = call() if caller is None else caller.call(call, n, _cancel_hook(rf.func))
            if output is TIMED_OUT:
                timed_out[col] = True
                continue
            if inspect.isawaitable(output):
                if inspect.iscoroutine(output):
                    output.close()
                raise TypeError(
                    f"reward function '{rf.name}' returned an awaitable but is not declared "
                    "`async def`; declare the function (or its __call__) `async def`."
                )
            rewards[:, col] = to_column(rf.name, output, n, is_model=isinstance(rf.func, RewardModel))
        for col, output in zip(async_cols, self._run_async(async_cols, kwargs, logs, n)):
            if output is TIMED_OUT:
                timed_out[col] = True
            else:
                rewards[:, col] = to_column(self.funcs[col].name, output, n)

        metrics: dict[str, list[float]] = {}
        extras: dict[str, list[Any]] = {}
        for log, late in zip(logs, timed_out):
            if not late:
                log.merge_into(metrics, extras)
        self._warn_all_nan(rewards, prompts, completions)
        return RewardScores(rewards, self.names, metrics, extras, timed_out if any(timed_out) else [])

    def _run_async(self, cols: list[int], kwargs: dict[str, Any], logs: list["_CallLog"], n: int) -> list[Any]:
        """Run the async functions ``cols`` concurrently; their outputs (or ``TIMED_OUT``) in order."""
        if not cols:
            return []

        async def _one(rf: RewardFunction, call_kwargs: dict[str, Any], limit: float | None) -> Any:
            try:
                return await await_with_timeout(lambda: rf.func(**call_kwargs), limit)
            except Exception as err:
                _add_note(err, rf.name)
                raise _AsyncError(err) from err  # a TimeoutError would cross threads as a new object

        futures = [async_loop.submit(_one(self.funcs[c], logs[c].kwargs(kwargs), self.timeouts[c])) for c in cols]
        deadline = async_deadline([self.timeouts[c] for c in cols])
        _, pending = concurrent.futures.wait(futures, deadline, return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
        if failed:  # like asyncio.gather: the first error is raised, the other calls are abandoned
            for future in pending:
                future.cancel()
            error = failed[0].exception()
            raise error.error if isinstance(error, _AsyncError) else error  # type: ignore[misc]
        outputs = []
        for col, future in zip(cols, futures):
            rf, limit = self.funcs[col], self.timeouts[col]
            if future in pending:  # the event loop is blocked: a coroutine runs blocking code
                future.cancel()
                timeout_warning(rf.name, limit or 0.0, n, "The event loop was blocked past the limit (an async "
                                "reward function runs blocking code without awaiting; use asyncio.to_thread).")
                outputs.append(TIMED_OUT)
                continue
            output = future.result()
            if output is TIMED_OUT:
                timeout_warning(rf.name, limit or 0.0, n, "The call was cancelled.")
            outputs.append(output)
        return outputs

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


class _AsyncError(Exception):
    """Carries an async reward function's exception out of the event loop unchanged."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class _CallLog:
    """What one reward call pushed through ``log_metric`` and ``log_extra``."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = {}
        self.extras: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        self.extras.setdefault(str(column), []).extend(list(values))

    def kwargs(self, shared: dict[str, Any]) -> dict[str, Any]:
        """The call's keyword arguments: ``shared`` plus this call's ``log_metric``/``log_extra``."""
        return {**shared, "log_extra": self.log_extra, "log_metric": self.log_metric}

    def merge_into(self, metrics: dict[str, list[float]], extras: dict[str, list[Any]]) -> None:
        for name, values in self.metrics.items():
            metrics.setdefault(name, []).extend(values)
        for column, values in self.extras.items():
            extras.setdefault(column, []).extend(values)


def _cancel_hook(func: Any) -> Any:
    """The callable's ``cancel_reward_call`` method, told when its call timed out (or ``None``)."""
    hook = getattr(func, "cancel_reward_call", None)
    return hook if callable(hook) else None


def _call_with_context(rf: RewardFunction, kwargs: dict[str, Any]) -> Any:
    try:
        return rf.func(**kwargs)
    except Exception as err:
        _add_note(err, rf.name)
        raise


def _add_note(err: BaseException, name: str) -> None:
    if hasattr(err, "add_note"):
        err.add_note(f"(raised by reward function '{name}')")

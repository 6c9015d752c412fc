"""Time limits for reward calls (``data.reward_timeout_s``).

A reward call that runs past its limit scores ``None`` for all of its completions (NaN: "not
applicable", spec §5.2), so one hung HTTP judge or stuck verifier cannot stall a run.

* **Sync functions and reward models** run in a daemon worker thread while the training thread
  waits at most the limit. A Python thread cannot be killed: a timed-out call keeps running in the
  background and its result is discarded. At most one call per function is ever in flight: while
  a timed-out call is still running, the next batch does not start another one (it scores
  ``None`` at once, with a warning), so repeated timeouts hold at most one thread per function.
  A callable with a ``cancel_reward_call()`` method is told when its call timed out
  (:class:`~grpo_lightning.rewards.RewardModel` then stops at its next ``batch_size`` chunk).
  A process pool could kill a call, but reward functions receive closures (``log_metric``),
  the trainer state and arbitrary objects that need not pickle, so the thread is the only
  general choice.
* **Async functions** are awaited with ``asyncio.wait``; a late one is cancelled (``CancelledError``
  at its next ``await``). A coroutine that blocks the event loop without awaiting cannot be
  cancelled: the training thread then gives up after the longest limit plus a grace period and
  scores every unfinished async function ``None``.

Functions without a limit run exactly as before (sync ones in the training thread).

Layer L1: standard library and torch, no lightning.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import numbers
import threading
import time
from typing import Any, Awaitable, Callable, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)

SETTING = "data.reward_timeout_s"


class _TimedOut:
    """The result of a call that ran past its limit (a sentinel, never a reward)."""

    def __repr__(self) -> str:
        return "TIMED_OUT"


TIMED_OUT: Any = _TimedOut()


def resolve_timeouts(setting: float | Mapping[str, float | None] | None, names: Sequence[str]) -> list[float | None]:
    """One limit per reward function from the ``data.reward_timeout_s`` setting.

    Args:
        setting: ``None`` (no limits), seconds for every function, or ``{name: seconds}`` for the
            named functions only (names as in ``rewards/<name>/mean``; ``null`` = no limit).
        names: The reward function names, in column order.

    Returns:
        Seconds (or ``None``) per function, in column order.

    Raises:
        ValueError: For a limit that is not a positive finite number, or an unknown name.
    """
    if setting is None:
        return [None] * len(names)
    if isinstance(setting, Mapping):
        unknown = [key for key in setting if key not in names]
        if unknown:
            raise ValueError(
                f"{SETTING} names {', '.join(map(repr, unknown))}, which is not a reward function; the reward "
                f"functions are {', '.join(map(repr, names))} (the names of rewards/<name>/mean)."
            )
        return [_check_seconds(setting.get(name), f"{SETTING}.{name}") for name in names]
    return [_check_seconds(setting, SETTING)] * len(names)


def _check_seconds(value: Any, label: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{label}={value!r}: give the seconds a reward call may take (a positive number), "
            "or null for no limit."
        )
    return float(value)


def timeout_warning(name: str, timeout_s: float, rows: int, what: str) -> None:
    """Log that reward function ``name`` timed out and what became of the call (``what``)."""
    logger.warning(
        "reward function %r did not return within %g s (%s): its %d completion(s) score None "
        "(rewards/%s/frac_timeout). %s",
        name, timeout_s, SETTING, rows, name, what,
    )  # fmt: skip


class BackgroundCaller:
    """Runs one sync reward function's calls in a daemon thread, waiting at most ``timeout_s``.

    Args:
        name: The reward function's name (for warnings).
        timeout_s: Seconds a call may take.
    """

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._running: concurrent.futures.Future | None = None  # a timed-out call not yet finished

    @property
    def busy(self) -> bool:
        """Whether a timed-out call of this function is still running in its thread."""
        return self._running is not None and not self._running.done()

    def call(self, func: Callable[[], Any], rows: int, cancel: Callable[[], Any] | None = None) -> Any:
        """``func()`` if it returns within the limit, else :data:`TIMED_OUT`.

        Args:
            func: The call, with its arguments bound.
            rows: Completions the call scores (for the warning).
            cancel: Called once when the call times out (``cancel_reward_call`` of the callable).

        Returns:
            What ``func`` returned, or :data:`TIMED_OUT`. Its exception, if it raised in time,
            is re-raised here.
        """
        if self.busy:
            timeout_warning(self.name, self.timeout_s, rows,
                            "Its call from an earlier batch is still running, so no new call was started.")
            return TIMED_OUT
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        started = time.monotonic()
        device = _current_cuda_device()

        def work() -> None:
            try:
                if device is not None:  # the current CUDA device is per thread: keep this rank's
                    torch.cuda.set_device(device)
                future.set_result(func())
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(err)

        threading.Thread(target=work, name=f"grpo-reward-{self.name}", daemon=True).start()
        done, _ = concurrent.futures.wait([future], timeout=self.timeout_s)
        if done:
            return future.result()
        self._running = future
        future.add_done_callback(lambda f: self._finished_late(f, started))
        if cancel is not None:
            try:
                cancel()
            except Exception:  # noqa: BLE001 - a failing cancel hook must not stop training
                logger.exception("cancel_reward_call() of reward function %r raised", self.name)
        timeout_warning(self.name, self.timeout_s, rows,
                        "The call keeps running in a background thread (Python threads cannot be killed); "
                        "its result will be discarded.")
        return TIMED_OUT

    def _finished_late(self, future: concurrent.futures.Future, started: float) -> None:
        error = future.exception()
        outcome = f"raised {type(error).__name__}: {error}" if error is not None else "returned"
        logger.info("reward function %r %s after %.1f s, past its %g s limit; the result is discarded.",
                    self.name, outcome, time.monotonic() - started, self.timeout_s)


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device, if CUDA is in use (a new thread would start on device 0)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


async def await_with_timeout(make_call: Callable[[], Awaitable[Any]], timeout_s: float | None) -> Any:
    """Await ``make_call()``; past ``timeout_s`` cancel it and return :data:`TIMED_OUT`.

    Unlike ``asyncio.wait_for``, a ``TimeoutError`` raised by the function itself (its own HTTP
    timeout, say) stays an error of the function instead of reading as our limit.
    """
    if timeout_s is None:
        return await make_call()
    task = asyncio.ensure_future(make_call())
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if task in done:
        return task.result()
    task.cancel()
    task.add_done_callback(_retrieve)  # a task that ignores the cancellation and then raises stays quiet
    return TIMED_OUT


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.info("a timed-out async reward call raised after its limit: %r", task.exception())


def async_deadline(timeouts: Sequence[float | None]) -> float | None:
    """How long the training thread waits for the async functions: the longest limit plus a
    grace period (for a coroutine that blocks the event loop); ``None`` if one has no limit."""
    if not timeouts or any(t is None for t in timeouts):
        return None
    longest = max(t for t in timeouts if t is not None)
    return longest + max(1.0, 0.1 * longest)


def timeout_metrics(
    timed_out_rows: Sequence[float], total_rows: float, names: Sequence[str], timeouts: Sequence[float | None]
) -> dict[str, float]:
    """``rewards/<name>/frac_timeout`` for every function that has a limit.

    Args:
        timed_out_rows: ``(F,)`` completions (summed over ranks) whose call of each function timed out.
        total_rows: Completions scored (summed over ranks).
        names: The ``F`` reward function names.
        timeouts: The ``F`` limits (``None``: no metric for that function).

    Returns:
        The fraction of completions whose call timed out, per function with a limit.

    >>> timeout_metrics([4.0, 0.0, 0.0], 16, ["judge", "fmt", "len"], [2.0, 2.0, None])
    {'rewards/judge/frac_timeout': 0.25, 'rewards/fmt/frac_timeout': 0.0}
    """
    rows = max(float(total_rows), 1.0)
    return {
        f"rewards/{name}/frac_timeout": float(count) / rows
        for name, count, limit in zip(names, timed_out_rows, timeouts)
        if limit is not None
    }


def gathered_timeout_metrics(
    timed_out: Sequence[bool], local_rows: int, gather_rows: Callable[[torch.Tensor], torch.Tensor],
    names: Sequence[str], timeouts: Sequence[float | None], device: torch.device | str = "cpu",
) -> dict[str, float]:
    """:func:`timeout_metrics` over all ranks: each rank's timed-out rows and scored rows summed.

    Args:
        timed_out: ``RewardScores.timed_out`` of this rank (``[]``: nothing timed out).
        local_rows: Completions this rank scored.
        gather_rows: Concatenates every rank's rows, ``(1, F+1) -> (P, F+1)`` (``Collective.gather_rows``).
        names, timeouts: As for :func:`timeout_metrics`.
        device: Where the gathered tensor lives (the collective's device).

    Returns:
        The same value on every rank.
    """
    flags = torch.tensor([bool(t) for t in timed_out] or [False] * len(names), dtype=torch.float32)
    local = torch.cat([flags * local_rows, torch.tensor([float(local_rows)])]).to(device)  # (F+1,)
    totals = gather_rows(local.unsqueeze(0)).sum(0).tolist()  # (P, F+1) -> (F+1,)
    return timeout_metrics(totals[:-1], totals[-1], names, timeouts)

"""Metric bookkeeping with TRL's semantics (spec §4).

Values are appended per generation batch (generation-side metrics) or per micro-step (loss-side
metrics) and, at each log, averaged after dropping NaNs, then cleared. Loss-side metrics are first
reduced exactly across ranks (sums and counts, or min/max), one collective per reduce op.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from grpo_lightning.types import MetricValue

# (tensor, op in {"sum", "min", "max"}) -> reduced tensor; identity on a single process.
AllReduce = Callable[[torch.Tensor, str], torch.Tensor]

# Metrics logged at their latest value, not as the mean since the last log, as the HF Trainer
# does: the running total ``num_tokens``, and the last step's ``grad_norm`` and ``learning_rate``.
LATEST_VALUE_METRICS = frozenset({"num_tokens", "grad_norm", "learning_rate"})


def reduce_metric_values(metrics: dict[Hashable, MetricValue], all_reduce: AllReduce | None) -> dict[Hashable, float]:
    """Global values of loss-side metrics: ``Σ total / Σ count`` for means, min/max otherwise."""
    out: dict[Hashable, float] = {}
    for op in ("mean", "min", "max"):
        names = [n for n, m in metrics.items() if m.reduce == op]
        if not names:
            continue
        if op == "mean":
            stacked = torch.stack(
                [torch.stack([metrics[n].total.detach().float(), metrics[n].count.detach().float()]) for n in names]
            )  # (M, 2)
            if all_reduce is not None:
                stacked = all_reduce(stacked, "sum")
            for name, (total, count) in zip(names, stacked.tolist()):
                out[name] = total / count if count > 0 else math.nan
        else:
            stacked = torch.stack([metrics[n].total.detach().float() for n in names])  # (M,)
            if all_reduce is not None:
                # NaN means "no value on this rank": make it neutral for the reduction.
                neutral = math.inf if op == "min" else -math.inf
                stacked = all_reduce(torch.nan_to_num(stacked, nan=neutral), op)
            for name, value in zip(names, stacked.tolist()):
                out[name] = value if math.isfinite(value) else math.nan
    return out


def world_row_mean(value: torch.Tensor, rows: int, all_reduce: AllReduce | None) -> tuple[float, float]:
    """The mean over all ranks' rows of a per-rank mean ``value`` over ``rows`` rows, and the
    rows of all ranks (one collective)."""
    stacked = torch.stack([value.detach().float().reshape(()) * rows, value.new_tensor(float(rows)).float()])  # (2,)
    if all_reduce is not None:
        stacked = all_reduce(stacked, "sum")
    total, count = stacked.tolist()
    return total / count, count


@dataclass(frozen=True)
class WindowMark:
    """How many values of each metric a :class:`MetricsWindow` held, and its latest values."""

    lengths: dict[str, int]
    latest: dict[str, float]


class MetricsWindow:
    """Collects metric values between two logging events; a value may carry a weight (the rows it
    covers: ``eval_loss`` is HF's per-row mean, not a mean over evaluation steps)."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)
        self._weights: dict[str, list[float]] = defaultdict(list)  # parallel to _values
        self._latest: dict[str, float] = {}

    def add(self, values: dict[str, float], weight: float = 1.0) -> None:
        for name, value in values.items():
            if name in LATEST_VALUE_METRICS:
                self._latest[name] = float(value)
            else:
                self._values[name].append(float(value))
                self._weights[name].append(float(weight))

    def __bool__(self) -> bool:
        return bool(self._values) or bool(self._latest)

    def mark(self) -> WindowMark:
        """A mark of what is held now, for :meth:`state_dict` to leave out what is added after it."""
        return WindowMark({k: len(v) for k, v in self._values.items()}, dict(self._latest))

    def state_dict(self, upto: WindowMark | None = None) -> dict[str, dict]:
        """What was added since the last flush (plain lists and floats: a checkpoint holds it), up
        to the :meth:`mark` ``upto`` when given."""
        def kept(name: str) -> int | None:
            return None if upto is None else upto.lengths.get(name, 0)

        return {"values": {k: v[:kept(k)] for k, v in self._values.items() if kept(k) != 0},
                "weights": {k: v[:kept(k)] for k, v in self._weights.items() if kept(k) != 0},
                "latest": dict(self._latest if upto is None else upto.latest)}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        self._values = defaultdict(list, {k: list(v) for k, v in state["values"].items()})
        weights = state.get("weights", {})  # checkpoints before weights: every value weighs 1
        self._weights = defaultdict(list, {k: list(weights.get(k, [1.0] * len(v))) for k, v in self._values.items()})
        self._latest = dict(state["latest"])

    def flush(self) -> dict[str, float]:
        """NaN-dropping (weighted) means of everything added since the last flush (NaN if nothing
        valid); the latest value of the :data:`LATEST_VALUE_METRICS`."""
        out = dict(self._latest)
        for name, values in self._values.items():
            valid = [(v, w) for v, w in zip(values, self._weights[name]) if not math.isnan(v)]
            total_weight = sum(w for _, w in valid)
            out[name] = sum(v * w for v, w in valid) / total_weight if total_weight > 0 else math.nan
        self._values.clear()
        self._weights.clear()
        self._latest.clear()
        return out


class TrainingMetrics:
    """The training loop's metrics, kept two ways from the same values.

    * per optimizer step, for callbacks: :meth:`close_step` returns the step's values (means over
      its micro-steps and generation batches) when the step's gradients are complete;
    * since the last log, for the loggers: :meth:`flush_log` returns TRL's average-since-last-log
      (spec §4: generation metrics once per generation batch, loss metrics once per micro-step,
      ``loss``/``grad_norm``/``step_time``/... once per optimizer step).

    ``loss`` and ``seconds`` accumulate the current step's TRL-scale loss (a detached tensor on
    the device) and wall time (the finished micro-batches' and the generation's);
    ``batch_started`` is when the running micro-batch started.

    Loss-side metrics (:meth:`add_micro_step`) stay on the device until the step closes: they are
    then reduced across ranks for all micro-steps in one collective per reduce op and read once.
    Reading them per micro-step would wait, between each forward and its backward, for the
    forward to finish (and, under DDP, for the slowest rank's).
    """

    def __init__(self) -> None:
        self._step = MetricsWindow()
        self._log = MetricsWindow()
        self._pending: list[dict[str, MetricValue]] = []
        self._all_reduce: AllReduce | None = None
        self._at_step_end = self._log.mark()  # the loggers' window when the last optimizer step ended
        self._window_open = False  # values of an unfinished optimizer step were added since
        self.loss: torch.Tensor | float = 0.0
        self.seconds = 0.0
        self.batch_started = 0.0

    def add_micro_step(self, metrics: dict[str, MetricValue], all_reduce: AllReduce | None) -> None:
        """One micro-step's loss-side metrics, kept unread (``all_reduce``: across ranks, or None)."""
        self._pending.append({name: MetricValue(m.total.detach(), m.count.detach(), m.reduce)
                              for name, m in metrics.items()})
        self._all_reduce = all_reduce
        self._window_open = True

    def _resolve(self) -> None:
        """The pending micro-steps' global values, each appended in micro-step order."""
        if not self._pending:
            return
        merged = {(index, name): value for index, metrics in enumerate(self._pending) for name, value in metrics.items()}
        values = reduce_metric_values(merged, self._all_reduce)  # the same keys in the same order on every rank
        for index in range(len(self._pending)):
            self._add({name: value for (i, name), value in values.items() if i == index})
        self._pending.clear()

    def step_seconds(self) -> float:
        """The current step's wall time so far: ``seconds`` plus the running micro-batch's."""
        return self.seconds + time.perf_counter() - self.batch_started

    def add(self, values: dict[str, float]) -> None:
        """Values of the running optimizer step (a generation batch's metrics)."""
        self._add(values)
        self._window_open = True

    def _add(self, values: dict[str, float]) -> None:
        self._step.add(values)
        self._log.add(values)

    def close_step(self, once_per_step: dict[str, float]) -> dict[str, float]:
        """Add the once-per-step values and return the finished step's metrics (NaNs dropped)."""
        self._resolve()
        self._add(once_per_step)
        self.loss, self.seconds = 0.0, 0.0
        self._at_step_end, self._window_open = self._log.mark(), False
        return {name: value for name, value in self._step.flush().items() if not math.isnan(value)}

    def flush_log(self) -> dict[str, float]:
        """The loggers' values since the last log (NaNs dropped), then cleared."""
        self._resolve()
        out = {name: value for name, value in self._log.flush().items() if not math.isnan(value)}
        self._at_step_end = self._log.mark()
        return out

    def __bool__(self) -> bool:
        return bool(self._log) or bool(self._pending)

    def state_dict(self) -> dict[str, dict]:
        """The loggers' window since the last log: a run resumed from a checkpoint written between two
        logs (``log_every_n_steps > 1``) logs the same averages as one that never stopped. Written
        inside an optimizer step (a failure in a micro-step), the window as that step started: the
        resumed run trains the step again from its start (``utils/accumulation_window.py``)."""
        if self._window_open:
            return {"log": self._log.state_dict(upto=self._at_step_end)}
        self._resolve()
        return {"log": self._log.state_dict()}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        self._log.load_state_dict(state["log"])
        self._at_step_end, self._window_open = self._log.mark(), False

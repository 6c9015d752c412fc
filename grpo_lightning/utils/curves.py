"""Training curves: which metrics go on which panel, and a grid of panels drawn to a PNG.

Layer L0 (no lightning). matplotlib is imported only when a figure is drawn, with the Agg backend
(no display needed). ``grpo plot`` (``grpo_lightning.cli.plot``) reads the series from a run's
MLflow store and calls :func:`plan_panels` then :func:`draw_curves`.

A panel is a title and a list of metric-name patterns (``fnmatch`` globs, e.g. ``rewards/*/mean``);
the series on it are the metrics that match, exact names first in pattern order, then each glob's
matches sorted. A panel that matches nothing is left out, so the grid holds only what the run logged.

>>> [p.title for p in plan_panels(["reward", "rewards/acc/mean", "entropy", "loss"])]
['reward', 'entropy']
>>> plan_panels(["reward", "rewards/acc/mean"])[0].metrics
('reward', 'rewards/acc/mean')
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Sequence

# Defaults of `grpo plot`: TRL's metric names (spec §4). Loss-side metrics are absent when they do not
# apply (no `kl` when beta = 0; clip ratios only for the clipped losses), and their panels with them.
DEFAULT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward", "rewards/*/mean")),
    ("kl", ("kl",)),
    ("entropy", ("entropy",)),
    ("clip ratio", ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "cispo_clip_ratio")),
    ("completion length", ("completions/mean_length", "completions/min_length", "completions/max_length")),
    # `eval_<set>_reward` per named eval set (docs/evaluation.md); per-function means for the unnamed one.
    ("eval reward", ("eval_reward", "eval_*_reward", "eval_rewards/*/mean")),
)
PANEL_WIDTH_IN, PANEL_HEIGHT_IN = 4.0, 3.0  # inches per panel; the PNG is (cols x rows) panels at `dpi`
MAX_COLUMNS = 3


@dataclass(frozen=True)
class Panel:
    """One plot of the grid: its title and the metrics drawn on it, in legend order."""

    title: str
    metrics: tuple[str, ...]


@dataclass(frozen=True)
class Series:
    """One metric over optimizer steps (``steps[i]`` is where ``values[i]`` was logged)."""

    name: str
    steps: tuple[int, ...]
    values: tuple[float, ...]


def match_metrics(patterns: Sequence[str], available: Sequence[str]) -> tuple[str, ...]:
    """The names in ``available`` that ``patterns`` select, each once: exact names in pattern order,
    a glob's matches sorted."""
    chosen: list[str] = []
    present = set(available)
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            found = sorted(name for name in present if fnmatchcase(name, pattern))
        else:
            found = [pattern] if pattern in present else []
        chosen += [name for name in found if name not in chosen]
    return tuple(chosen)


def plan_panels(available: Sequence[str],
                panels: Sequence[tuple[str, Sequence[str]]] = DEFAULT_PANELS) -> list[Panel]:
    """The panels of ``panels`` (title, patterns) that match at least one name in ``available``."""
    planned = [Panel(title, match_metrics(patterns, available)) for title, patterns in panels]
    return [panel for panel in planned if panel.metrics]


def grid_shape(n_panels: int) -> tuple[int, int]:
    """(rows, columns) of the grid: up to ``MAX_COLUMNS`` panels a row.

    >>> grid_shape(1), grid_shape(3), grid_shape(5)
    ((1, 1), (1, 3), (2, 3))
    """
    if n_panels < 1:
        raise ValueError("a figure needs at least one panel")
    cols = min(MAX_COLUMNS, n_panels)
    return math.ceil(n_panels / cols), cols


def import_pyplot():  # -> the matplotlib.pyplot module
    """``matplotlib.pyplot`` on the Agg backend (files only, no display), or an ImportError saying how to install it."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "Drawing curves needs matplotlib (a dependency of grpo-lightning, normally installed with it): "
            "pip install matplotlib") from error
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def draw_curves(panels: Sequence[Panel], series: dict[str, Series], output: str, *, title: str = "",
                dpi: int = 80) -> int:
    """Draws ``panels`` (a grid, ``MAX_COLUMNS`` a row) from ``series`` to the PNG ``output``;
    returns the number of panels drawn. The image is exactly (cols x ``PANEL_WIDTH_IN``) by
    (rows x ``PANEL_HEIGHT_IN``) inches at ``dpi``. A panel with several metrics has a legend."""
    missing = sorted({name for panel in panels for name in panel.metrics} - set(series))
    if missing:
        raise ValueError(f"no series for the metrics {missing}")
    plt = import_pyplot()
    rows, cols = grid_shape(len(panels))
    fig, axes = plt.subplots(rows, cols, figsize=(cols * PANEL_WIDTH_IN, rows * PANEL_HEIGHT_IN), squeeze=False,
                             layout="constrained")
    try:
        for index, ax in enumerate(axes.flat):
            if index >= len(panels):
                ax.set_visible(False)
                continue
            panel = panels[index]
            for name in panel.metrics:
                curve = series[name]
                # One logged point draws as a dot; a line needs two.
                ax.plot(curve.steps, curve.values, label=name, linewidth=1.4, marker="." if len(curve.steps) < 2 else None)
            ax.set_title(panel.title)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
            if len(panel.metrics) > 1:
                ax.legend(fontsize="small")
        if title:
            fig.suptitle(title, fontsize="medium")
        folder = os.path.dirname(os.path.abspath(output))
        os.makedirs(folder, exist_ok=True)
        fig.savefig(output, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    return len(panels)


__all__ = ["DEFAULT_PANELS", "Panel", "Series", "draw_curves", "grid_shape", "import_pyplot", "match_metrics",
           "plan_panels"]

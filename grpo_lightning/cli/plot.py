"""``grpo plot RUN_DIR``: a run's training curves, from its MLflow store, as one PNG.

Layer L6. Not a LightningCLI subcommand: ``grpo_lightning.cli.main`` hands ``plot ...`` here before
LightningCLI parses anything. The store is the one ``grpo fit`` writes by default,
``<RUN_DIR>/mlflow.db``; the run is ``--run-id``, else the one ``<RUN_DIR>/run.json`` names, else
the newest run in the store. Each metric's history is read whole (every logged step); where a step
was logged twice (a resume that repeated steps) the later value is drawn.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Sequence

from grpo_lightning.cli.checkpoints import read_run_record
from grpo_lightning.errors import ConfigError
from grpo_lightning.utils.curves import DEFAULT_PANELS, Panel, Series, draw_curves, import_pyplot, plan_panels

STORE_FILE = "mlflow.db"
DEFAULT_OUTPUT = "curves.png"
DESCRIPTION = (
    "Draw a run's training curves (reward and per-function rewards, KL, entropy, clip ratios, completion "
    "lengths, eval reward: those the run logged) from its MLflow store <RUN_DIR>/mlflow.db to a PNG, and "
    "print the PNG's path."
)
EPILOG = (
    "Examples:  grpo plot runs/quickstart   |   grpo plot runs/x --metrics reward,eval_reward loss 'clip_ratio/*'   "
    "|   grpo plot runs/x --output x.png --run-id 38bdc395...   Metric names are TRL's (docs/plotting.md)."
)


@dataclass(frozen=True)
class RunCurves:
    """What ``grpo plot`` drew: the PNG, the MLflow run it came from, its panels."""

    output: str
    run_id: str
    panels: tuple[Panel, ...]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo plot", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="A run folder (the trainer.default_root_dir of `grpo fit`) holding mlflow.db.")
    parser.add_argument("--output", "-o", metavar="PNG", default=None,
                        help=f"Where to write the PNG (default: <RUN_DIR>/{DEFAULT_OUTPUT}).")
    parser.add_argument("--metrics", nargs="+", metavar="PANEL", default=None,
                        help="Panels to draw instead of the defaults, one per argument; an argument is a comma-"
                             "separated list of metric names or globs drawn together, e.g. reward,eval_reward "
                             "'rewards/*/mean' loss. Every one must match a logged metric.")
    parser.add_argument("--run-id", default=None,
                        help="The MLflow run to draw (default: the run run.json names, else the newest in the store).")
    parser.add_argument("--title", default=None,
                        help="The figure's title (default: RUN_DIR and the MLflow run's name).")
    parser.add_argument("--dpi", type=int, default=80,
                        help="Resolution of the PNG; each panel is 4 x 3 inches (default: 80, i.e. 320 x 240 pixels).")
    return parser


def panels_from_args(metrics: Sequence[str] | None) -> list[tuple[str, tuple[str, ...]]]:
    """(title, patterns) per panel: ``--metrics`` (``"a,b"`` is one panel of two), else the defaults."""
    if metrics is None:
        return [(title, patterns) for title, patterns in DEFAULT_PANELS]
    panels = []
    for argument in metrics:
        patterns = tuple(p.strip() for p in argument.split(",") if p.strip())
        if not patterns:
            raise ConfigError(f"--metrics {argument!r}: name at least one metric per panel, e.g. --metrics reward kl.")
        panels.append((", ".join(patterns), patterns))
    return panels


def open_store(run_dir: str) -> Any:  # -> mlflow.tracking.MlflowClient
    """A client of ``<run_dir>/mlflow.db``; an error naming ``run_dir`` when it has none (a client
    would otherwise create an empty store there)."""
    from grpo_lightning.cli import mlflow_logger_config

    if not os.path.isdir(run_dir):
        raise ConfigError(f"grpo plot {run_dir}: no such folder. Give a run folder (the trainer.default_root_dir "
                          "of a `grpo fit` run).")
    if not os.path.isfile(os.path.join(run_dir, STORE_FILE)):
        raise ConfigError(
            f"grpo plot {run_dir}: no MLflow store ({STORE_FILE}) in this folder. `grpo fit` writes one there when no "
            "other logger is configured; give the trainer.default_root_dir of such a run.")
    from mlflow.tracking import MlflowClient

    return MlflowClient(mlflow_logger_config(run_dir)["init_args"]["tracking_uri"])


def choose_run(client: Any, run_dir: str, run_id: str | None) -> Any:  # -> mlflow.entities.Run
    """``run_id``, else the run of ``run.json``, else the newest run in the store."""
    from mlflow.exceptions import MlflowException

    record = read_run_record(run_dir)
    wanted, source = (run_id, "--run-id") if run_id else ((record or {}).get("mlflow_run_id"), "run.json")
    if wanted:
        try:
            return client.get_run(wanted)
        except MlflowException:
            raise ConfigError(f"grpo plot {run_dir}: {source} names MLflow run {wanted}, which is not in "
                              f"{os.path.join(run_dir, STORE_FILE)}. Pass the --run-id of a run in this store "
                              "(`mlflow ui` lists them).") from None
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, order_by=["attributes.start_time DESC"], max_results=1) if experiments else []
    if not runs:
        raise ConfigError(f"grpo plot {run_dir}: the MLflow store {os.path.join(run_dir, STORE_FILE)} holds no run.")
    return runs[0]


def metric_series(client: Any, run_id: str, name: str) -> Series:
    """The history of ``name`` by step; a step logged more than once keeps its latest value."""
    by_step: dict[int, float] = {}
    for point in sorted(client.get_metric_history(run_id, name), key=lambda m: (m.step, m.timestamp)):
        by_step[int(point.step)] = float(point.value)
    steps = sorted(by_step)
    return Series(name, tuple(steps), tuple(by_step[s] for s in steps))


def plot_run(run_dir: str, output: str | None = None, metrics: Sequence[str] | None = None,
             run_id: str | None = None, dpi: int = 80, title: str | None = None) -> RunCurves:
    """Draws the curves of the run in ``run_dir`` to ``output`` (default ``<run_dir>/curves.png``)."""
    if dpi < 10 or dpi > 600:
        raise ConfigError(f"--dpi {dpi}: give a resolution between 10 and 600 (default 80).")
    requested = panels_from_args(metrics)
    import_pyplot()  # a missing matplotlib fails before the store is read
    client = open_store(run_dir)
    run = choose_run(client, run_dir, run_id)
    run_id = run.info.run_id
    available = sorted(run.data.metrics)
    if not available:
        raise ConfigError(f"grpo plot {run_dir}: MLflow run {run_id} has logged no metrics yet.")
    panels = plan_panels(available, requested)
    if metrics is not None:
        drawn = {p.title for p in panels}
        unmatched = [title for title, _ in requested if title not in drawn]
        if unmatched:
            raise ConfigError(f"--metrics {' '.join(unmatched)}: no such metric in run {run_id}. Logged metrics: "
                              f"{', '.join(available)}.")
    elif not panels:
        raise ConfigError(f"grpo plot {run_dir}: run {run_id} logged none of the default curves' metrics; choose "
                          f"some with --metrics. Logged metrics: {', '.join(available)}.")
    series = {name: metric_series(client, run_id, name) for panel in panels for name in panel.metrics}
    output = output or os.path.join(run_dir, DEFAULT_OUTPUT)
    title = f"{os.path.normpath(run_dir)}  (MLflow run {run.info.run_name or run_id})" if title is None else title
    draw_curves(panels, series, output, title=title, dpi=dpi)
    return RunCurves(output, run_id, tuple(panels))


def plot_main(argv: Sequence[str]) -> None:
    """``grpo plot ...`` (``argv`` without ``plot``): draw the curves and print the PNG's path."""
    args = build_parser().parse_args(list(argv))
    result = plot_run(args.run_dir, args.output, args.metrics, args.run_id, args.dpi, args.title)
    print(result.output)


__all__ = ["RunCurves", "build_parser", "choose_run", "metric_series", "open_store", "panels_from_args", "plot_main",
           "plot_run"]

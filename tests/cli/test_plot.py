"""``grpo plot RUN_DIR``: curves from a real MLflow sqlite store (written with MLflow's own client)
to a PNG with one panel per group of logged metrics; the run it picks; its errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lightning.cli import main
from grpo_lightning.cli.checkpoints import write_run_record
from grpo_lightning.cli.plot import metric_series, open_store, panels_from_args, plot_run
from grpo_lightning.errors import ConfigError
from grpo_lightning.utils.curves import PANEL_HEIGHT_IN, PANEL_WIDTH_IN, match_metrics, plan_panels

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = [5, 10, 15, 20]
# What a dapo run with two reward functions, beta = 0 (no kl) and evaluation logs, plus `loss`,
# which no default panel shows.
LOGGED = {
    "reward": [0.2, 0.4, 0.5, 0.7],
    "rewards/acc/mean": [0.1, 0.3, 0.4, 0.6],
    "rewards/len/mean": [0.1, 0.1, 0.1, 0.1],
    "entropy": [1.2, 1.0, 0.9, 0.7],
    "clip_ratio/region_mean": [0.0, 0.01, 0.02, 0.01],
    "clip_ratio/low_mean": [0.0, 0.0, 0.01, 0.0],
    "clip_ratio/high_mean": [0.0, 0.01, 0.01, 0.01],
    "completions/mean_length": [9.0, 8.5, 8.0, 7.5],
    "loss": [0.01, -0.02, 0.0, 0.03],
}
EVAL = {"eval_reward": [(10, 0.35), (20, 0.65)]}


def make_store(run_dir: Path, runs: list[dict[str, list[tuple[int, float]]]], record_run: int | None = 0) -> list[str]:
    """``run_dir/mlflow.db`` with one MLflow run per entry of ``runs`` (metric -> (step, value)s), in
    order (the last is the newest); ``run.json`` names run ``record_run`` (None: no run.json)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    run_dir.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{run_dir.resolve()}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("grpo")
    ids = []
    for index, metrics in enumerate(runs):
        run = client.create_run(experiment, start_time=1_000_000 + index)
        points = [Metric(name, value, 1_000 + i, step) for name, history in metrics.items()
                  for i, (step, value) in enumerate(history)]
        if points:
            client.log_batch(run.info.run_id, metrics=points)
        client.set_terminated(run.info.run_id)
        ids.append(run.info.run_id)
    if record_run is not None:
        write_run_record(str(run_dir), ids[record_run], uri, "grpo")
    return ids


def training_metrics() -> dict[str, list[tuple[int, float]]]:
    return {**{name: list(zip(STEPS, values)) for name, values in LOGGED.items()}, **EVAL}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("run")
    make_store(folder, [training_metrics()])
    return folder


def cell_has_ink(image, rows: int, cols: int, row: int, col: int) -> bool:
    """Whether the middle half of grid cell (row, col) holds anything but white."""
    width, height = image.size
    w, h = width / cols, height / rows
    box = (int(col * w + w / 4), int(row * h + h / 4), int(col * w + 3 * w / 4), int(row * h + 3 * h / 4))
    return image.convert("L").crop(box).getextrema()[0] < 250


def test_plot_draws_a_png_with_one_panel_per_present_group(run_dir, capsys):
    pil = pytest.importorskip("PIL.Image")
    main(["plot", str(run_dir)])
    output = run_dir / "curves.png"
    assert capsys.readouterr().out.strip() == str(output)
    data = output.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    # reward, entropy, clip ratio, completion length, eval reward: 5 panels (no kl logged), a 2 x 3 grid.
    with pil.open(output) as image:
        image.load()
        assert image.size == (3 * PANEL_WIDTH_IN * 80, 2 * PANEL_HEIGHT_IN * 80)
        inked = [cell_has_ink(image, 2, 3, r, c) for r in range(2) for c in range(3)]
    assert inked == [True] * 5 + [False]


def test_plot_run_reports_the_panels_and_their_metrics(run_dir, tmp_path):
    result = plot_run(str(run_dir), str(tmp_path / "sub" / "c.png"))
    assert [(p.title, p.metrics) for p in result.panels] == [
        ("reward", ("reward", "rewards/acc/mean", "rewards/len/mean")),
        ("entropy", ("entropy",)),
        ("clip ratio", ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean")),
        ("completion length", ("completions/mean_length",)),
        ("eval reward", ("eval_reward",)),
    ]
    assert result.output == str(tmp_path / "sub" / "c.png") and (tmp_path / "sub" / "c.png").stat().st_size > 0


def test_metrics_choose_the_panels(run_dir, tmp_path, capsys):
    pil = pytest.importorskip("PIL.Image")
    out = tmp_path / "mine.png"
    main(["plot", str(run_dir), "--output", str(out), "--metrics", "reward,eval_reward", "loss", "--dpi", "50"])
    assert capsys.readouterr().out.strip() == str(out)
    with pil.open(out) as image:
        assert image.size == (2 * PANEL_WIDTH_IN * 50, PANEL_HEIGHT_IN * 50)
    result = plot_run(str(run_dir), str(out), metrics=["clip_ratio/*_mean"])
    assert [p.metrics for p in result.panels] == [
        ("clip_ratio/high_mean", "clip_ratio/low_mean", "clip_ratio/region_mean")]


def test_series_are_read_whole_by_step_and_a_repeated_step_keeps_its_latest_value(tmp_path):
    # A resume that repeated steps 10-15: logged later (larger timestamps), those values win.
    history = [(5, 1.0), (10, 2.0), (15, 3.0), (10, 20.0), (15, 30.0), (20, 4.0)]
    (run_id,) = make_store(tmp_path, [{"reward": history}])
    series = metric_series(open_store(str(tmp_path)), run_id, "reward")
    assert series.steps == (5, 10, 15, 20) and series.values == (1.0, 20.0, 30.0, 4.0)


def test_the_run_is_run_id_else_run_json_else_the_newest(tmp_path):
    metrics = {"reward": [(1, 0.5)]}
    older, newer = make_store(tmp_path / "a", [metrics, metrics], record_run=0)
    assert plot_run(str(tmp_path / "a")).run_id == older  # run.json
    assert plot_run(str(tmp_path / "a"), run_id=newer).run_id == newer
    os.remove(tmp_path / "a" / "run.json")
    assert plot_run(str(tmp_path / "a")).run_id == newer  # newest
    with pytest.raises(ConfigError, match="--run-id names MLflow run nope, which is not in"):
        plot_run(str(tmp_path / "a"), run_id="nope")


def test_a_folder_without_a_store_is_refused_and_left_without_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(tmp_path)])
    assert exit_info.value.code == 1
    message = capsys.readouterr().err
    assert f"grpo plot {tmp_path}: no MLflow store (mlflow.db) in this folder" in message
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "curves.png").exists()
    with pytest.raises(ConfigError, match="no such folder"):
        plot_run(str(tmp_path / "absent"))


def test_a_store_without_runs_or_metrics_is_refused(tmp_path):
    from mlflow.tracking import MlflowClient

    (tmp_path / "empty").mkdir()
    MlflowClient(f"sqlite:///{tmp_path}/empty/mlflow.db").create_experiment("grpo")
    with pytest.raises(ConfigError, match=r"empty: the MLflow store .*mlflow.db holds no run"):
        plot_run(str(tmp_path / "empty"))
    make_store(tmp_path / "quiet", [{}])
    with pytest.raises(ConfigError, match="has logged no metrics yet"):
        plot_run(str(tmp_path / "quiet"))
    make_store(tmp_path / "other", [{"loss": [(1, 0.1)]}])
    with pytest.raises(ConfigError, match="none of the default curves' metrics; choose some with --metrics. "
                                          "Logged metrics: loss"):
        plot_run(str(tmp_path / "other"))


def test_run_json_naming_a_run_absent_from_the_store_is_refused(tmp_path):
    make_store(tmp_path, [{"reward": [(1, 0.5)]}], record_run=None)
    write_run_record(str(tmp_path), "0123abcd", "sqlite:///elsewhere/mlflow.db", "grpo")
    with pytest.raises(ConfigError, match="run.json names MLflow run 0123abcd, which is not in .* Pass the --run-id"):
        plot_run(str(tmp_path))


def test_bad_metrics_and_dpi_are_refused_before_drawing(run_dir, tmp_path):
    out = tmp_path / "x.png"
    with pytest.raises(ConfigError, match=r"--metrics kl, rewards/\*/std: no such metric in run .* Logged metrics: "
                                          r"clip_ratio/high_mean, .*eval_reward, loss, reward"):
        plot_run(str(run_dir), str(out), metrics=["reward", "kl,rewards/*/std"])
    with pytest.raises(ConfigError, match="name at least one metric per panel"):
        plot_run(str(run_dir), str(out), metrics=[","])
    with pytest.raises(ConfigError, match="--dpi 0: give a resolution between 10 and 600"):
        plot_run(str(run_dir), str(out), dpi=0)
    assert not out.exists()


def test_missing_matplotlib_is_one_message_naming_the_install(run_dir, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(SystemExit):
        main(["plot", str(run_dir), "--output", str(tmp_path / "x.png")])
    message = capsys.readouterr().err
    assert "error: Drawing curves needs matplotlib" in message and "pip install matplotlib" in message
    assert not (tmp_path / "x.png").exists()


def test_panel_planning_orders_exact_names_then_sorted_globs_each_once():
    available = ["rewards/b/mean", "reward", "rewards/a/mean", "kl", "rewards/a/std"]
    assert match_metrics(["reward", "rewards/*/mean", "rewards/a/mean", "absent"], available) == (
        "reward", "rewards/a/mean", "rewards/b/mean")
    assert [p.title for p in plan_panels(available)] == ["reward", "kl"]
    named_sets = ["eval_math_reward", "eval_gsm8k_reward", "eval_gsm8k_rewards/acc/mean", "eval_gsm8k_reward_std"]
    assert plan_panels(named_sets)[0].metrics == ("eval_gsm8k_reward", "eval_math_reward")
    assert panels_from_args(["reward, eval_reward", "loss"]) == [
        ("reward, eval_reward", ("reward", "eval_reward")), ("loss", ("loss",))]


@pytest.mark.slow
def test_the_grpo_console_script_plots(run_dir, tmp_path):
    script = Path(sys.executable).parent / "grpo"
    if not script.exists():
        pytest.skip(f"no `grpo` console script beside {sys.executable} (pip install -e .)")
    out = tmp_path / "c.png"
    done = subprocess.run([str(script), "plot", str(run_dir), "-o", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)

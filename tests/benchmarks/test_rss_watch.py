"""benchmarks/rss_watch.py names the code that raises host memory (issue 15's 9.8 GB hunt)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark scripts import each other by name


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


rss_watch = _load("rss_watch")
pytestmark = pytest.mark.skipif(not rss_watch.read_status(), reason="needs Linux /proc/self/status")


def allocate_and_hold(mb: int, hold_s: float) -> torch.Tensor:
    block = torch.ones(mb * 2**20 // 4)  # touched pages: resident, anonymous
    time.sleep(hold_s)  # the watcher samples while this frame is on the main thread's stack
    return block


def test_a_rise_names_the_allocating_function_and_its_phase():
    watch = rss_watch.RssWatch(interval_s=0.005, step_mb=64).start()
    watch.phase = "generation"
    before = rss_watch.read_status()
    block = allocate_and_hold(400, hold_s=0.3)
    report = watch.stop()
    del block

    peak = report["peak"]
    assert report["available"] and report["samples"] > 0
    assert peak["rss_mb"] >= before["rss_mb"] + 350
    assert peak["anon_mb"] >= before["anon_mb"] + 350  # a tensor is anonymous memory, not a mapped file
    assert peak["phase"] == "generation"
    assert any("allocate_and_hold" in frame for frame in peak["stack"])
    last = report["rises"][-1]  # within one step (64 MB) of the peak, on the way up
    assert last["rss_mb"] >= peak["rss_mb"] - 64 and any("allocate_and_hold" in f for f in last["stack"])


def test_rises_are_kept_per_step_and_the_peak_is_the_maximum(monkeypatch):
    watch = rss_watch.RssWatch(interval_s=0.005, step_mb=100, max_rises=3)
    for rss in (1000, 1050, 1120, 1300, 1250, 1500, 1900):
        status = {"rss_mb": float(rss), "anon_mb": rss - 200.0, "file_mb": 200.0, "shmem_mb": 0.0}
        monkeypatch.setattr(rss_watch, "read_status", lambda: status)
        watch.sample()
    assert [r["rss_mb"] for r in watch.rises] == [1000, 1120, 1300]  # each 100 MB above the last kept, 3 at most
    assert watch.peak["rss_mb"] == 1900


def test_report_line_for_a_run():
    bench_report = _load("bench_report")
    run = {"repeat": 0, "rss_watch": {"peak": {
        "rss_mb": 9783.0, "anon_mb": 9000.0, "file_mb": 700.0, "shmem_mb": 83.0, "phase": "backward", "t_s": 30.0,
        "stack": ["/x/bench_child.py:5 main: run()", "/x/grpo_lightning/a.py:10 outer: f()",
                  "/x/grpo_lightning/chunked.py:88 head_chunk: logits = h @ w", "/x/torch/nn/linear.py:134 forward: F.linear()"]}}}
    (line,) = [ln for ln in bench_report.host_peak_lines({"ours": [run]}) if ln]
    assert "9,783 MB" in line and "anon 9,000" in line and "in backward" in line
    # innermost frame first, then the package's own frames outwards (3 in all)
    assert line.index("linear.py:134 forward") < line.index("chunked.py:88 head_chunk") < line.index("a.py:10 outer")
    assert "bench_child" not in line
    assert bench_report.host_peak_lines({"trl": [{"repeat": 0}]}) == []

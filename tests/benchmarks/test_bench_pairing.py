"""The benchmark report calls a comparison paired only where both trainers generated the same
completions, and issue 15's GPU targets are met only then (the second GPU run's ratio compared
different work: its completions drifted apart after the first update)."""

from __future__ import annotations

from tests.benchmarks.test_rss_watch import _load

bench_report = _load("bench_report")
compare_trl = _load("compare_trl")

PHASE_S = {"generation": 1.0, "reward": 0.001, "logprob": 0.0, "forward": 0.2, "backward": 0.3, "optimizer": 0.02}


def _run(completion_tokens: list[int], scale: float) -> dict:
    steps = [{**{k: v * scale for k, v in PHASE_S.items()}, "other": 0.01 * scale, "step_time": 1.531 * scale,
              "prompt_tokens": 100, "completion_tokens": c, "rows": 4, "truncated": 0, "max_completion": 9,
              "hf_generate_s": 0.9 * scale, "decode_steps": 9, "gc_s": 0.0}
             for c in completion_tokens]
    return {"steps": steps, "torch_threads": 8, "peak_rss_mb": 1000.0, "rss_train_start_mb": 500.0,
            "matmul_probe_gflops": 1.0}


def _ratios(ours_tokens: list[int], trl_tokens: list[int], trl_scale: float = 2.0) -> dict:
    ours, trl = _run(ours_tokens, 1.0), _run(trl_tokens, trl_scale)
    params = {"body": 10, "head": 5, "matmul": 15}
    summaries = [[bench_report.summarize_run(r, 1, params, 1.0, "cuda")] for r in (ours, trl)]
    return bench_report.ratios(*summaries, [ours], [trl], 1, "cuda")


def test_the_same_completions_are_paired_and_meet_the_targets():
    ratios = _ratios([50, 40, 30], [50, 40, 30])
    assert ratios["unpaired_steps"] == [] and ratios["completion_tokens_by_step"] == [[50, 50], [40, 40], [30, 30]]
    assert ratios["tokens_per_s"] == 2.0  # the same tokens in half the time
    rows = compare_trl.gpu_targets(ratios)
    assert len(rows) == 1 + len(bench_report.SPLIT) and all(row["met"] for row in rows)
    logprob = next(row for row in rows if row["target"].startswith("logprob"))
    assert "timer noise" in logprob["measured"]  # 0 s on both sides counts as even


def test_completions_that_drift_apart_are_reported_and_fail_the_targets():
    ratios = _ratios([50, 40, 30], [50, 60, 90])  # step 0 (warm-up) paired, then apart
    assert ratios["unpaired_steps"] == [1, 2]
    rows = compare_trl.gpu_targets(ratios)
    assert not any(row["met"] for row in rows) and all("not paired" in row["measured"] for row in rows)


def test_a_slower_phase_fails_its_target_only():
    ratios = _ratios([50, 40, 30], [50, 40, 30], trl_scale=2.0)
    ratios["phase_s"]["optimizer"] = [0.022, 0.014]  # run 2's optimizer phase: ours slower
    rows = {row["target"].split(" ")[0]: row["met"] for row in compare_trl.gpu_targets(ratios)}
    assert rows.pop("optimizer") is False and all(rows.values())


def test_the_time_inside_generate_is_reported_per_decode_step():
    params = {"body": 10, "head": 5, "matmul": 15}
    summaries = {"ours": [bench_report.summarize_run(_run([50, 40, 30], 1.0), 1, params, 1.0, "cuda")],
                 "trl": [bench_report.summarize_run(_run([50, 40, 30], 2.0), 1, params, 1.0, "cuda")]}
    ours, trl = bench_report.generate_call_lines(summaries)
    assert "0.900 s inside `model.generate` of 1.000 s" in ours and "100.0 ms per decode step" in ours
    assert trl.startswith("Generation, TRL") and "200.0 ms per decode step" in trl

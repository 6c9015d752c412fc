"""benchmarks/decode_step_cost.py measures every eager mode on a tiny shape, and the counts it
reports show what the modes differ in: autocast adds casts per decode step, the cast cache removes
the weights' share of them, the matmuls stay the same."""

from __future__ import annotations

import argparse

from tests.benchmarks.test_rss_watch import _load

decode_step_cost = _load("decode_step_cost")


def test_every_eager_mode_is_timed_and_the_cast_cache_casts_less():
    args = argparse.Namespace(device="cpu", hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=128,
                              rows=4, prompt_tokens=6, new_tokens=3, repeats=1, threads=1,
                              modes=list(decode_step_cost.DEFAULT_MODES))
    rows = {r["mode"]: r for r in decode_step_cost.measure(args)}
    assert list(rows) == ["fp32", "autocast", "autocast+cast_cache"]
    assert all(r["ms_per_step"] > 0 and len(r["ms_per_step_all"]) == 1 for r in rows.values())
    assert len({r["matmuls"] for r in rows.values()}) == 1 and rows["fp32"]["matmuls"] > 0
    # Without the cache every forward of a call (prefill + new_tokens - 1 decode steps) casts every
    # weight; with it the first forward does: 2 layers x (7 linear weights + 3 q/k/v biases) + the head.
    weights = 2 * (7 + 3) + 1
    saved = rows["autocast"]["casts_per_call"] - rows["autocast+cast_cache"]["casts_per_call"]
    assert saved == weights * (args.new_tokens - 1)
    assert rows["autocast"]["casts_per_call"] > rows["fp32"]["casts_per_call"]
    table = decode_step_cost.markdown(args, list(rows.values()), "test machine")
    assert "| autocast+cast_cache |" in table and "1.00×" in table

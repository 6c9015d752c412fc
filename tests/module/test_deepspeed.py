"""DeepSpeed ZeRO on CPU: a real engine (2 gloo processes, no Lightning) for the ZeRO-3 gathers,
the weight pushes and the export; and GRPOModule fits under GRPODeepSpeedStrategy (Lightning driving
DeepSpeed's CPU accelerator) against the single-device run.

DeepSpeed is not in the ``[dev]`` extra (an sdist build plus a C++ extension DeepSpeed compiles
at its first ``init_distributed`` on CPU): without it these tests are skipped, with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port, make_model_dir, write_prompts

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (pip install 'grpo-lightning[deepspeed]'; it is not part of [dev])",
)

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
# One float32 ulp at 1.0: the largest rounding error of w + 1 - 1 for |w| < 1.
ULP_AT_ONE = 2.0**-23


def _env(port: int, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), **extra}


@pytest.mark.slow
def test_zero3_engine_gathers_pushes_and_exports_whole_weights(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "deepspeed_zero3_child.py"), model_dir, str(tmp_path)],
                              env=_env(port, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2"), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-4000:]
    ranks = [json.loads((tmp_path / f"zero3_{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["partitioned_at_start"], "the policy was not partitioned at load (transformers' ZeRO-3 switch)"
        # gather once: whole inside, the engine's hooks off (a forward does not free the weights)
        assert r["gather_whole_inside"] and r["gather_hooks_inside"] == 0 and r["gather_whole_after_forward"]
        assert r["repartitioned_after"] and r["hooks_restored"]
        # generate sharded: the weights stay partitioned, the hooks fetch them per module
        assert r["sharded_partitioned_inside"]
        # same float32 weights, same kernels as the dense copy: bit-identical results
        assert r["gather_logits_diff"] == 0.0 and r["sharded_logits_diff"] == 0.0
        assert r["gather_greedy_equal"] and r["sharded_greedy_equal"]
        assert r["push_diff"] == 0.0 and r["push_inside_diff"] == 0.0 and r["push_keys_equal"] and r["shapes_equal"]
        assert r["writeback_diff"] <= ULP_AT_ONE / 2  # rank 0's +1 reached both ranks' shards
    assert ranks[0]["export_keys"] == 21 and ranks[0]["export_diff"] == 0.0
    assert ranks[0]["export_on_cpu"] and ranks[0]["export_shapes_equal"]
    assert ranks[1]["export_keys"] == 0, "only rank 0 keeps the consolidated export"


@pytest.mark.slow
def test_deepspeed_fits_match_the_single_device_run(tmp_path):
    """ZeRO-2 and ZeRO-3 (gather on and off), 2 accumulated micro-batches per step, a partitioned
    reference (beta 0.04): the same optimized log-prob forward, the same loss and grad_norm at the
    same steps, and the same exported weights, as one device; Lightning's plain backward (the
    engine divides again) does not."""
    model_dir = make_model_dir(tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", num_rows=8)
    result = subprocess.run([sys.executable, str(HERE / "deepspeed_fit_child.py"), model_dir, prompts, str(tmp_path)],
                            env=_env(free_port()), cwd=REPO, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    fits = json.loads((tmp_path / "fits.json").read_text())
    base = fits["single_device"]["steps"]
    assert [s["global_step"] for s in base] == [0, 1, 1, 2] and fits["moved"] > 1e-2
    single = fits["single_device"]["paths"]
    assert single["plain"] == 0 and single["optimized"] > 0
    assert single["no_grad_head_calls"] > single["no_grad_forwards"] > 0  # one call per chunk
    for name in ("zero3_gather", "zero3_sharded", "zero2"):
        # ZeRO-3 runs the chunked head and packing too: the head as its module's forward
        paths = fits[name]["paths"]
        assert {k: paths[k] for k in ("plain", "optimized", "no_grad_forwards")} == {
            k: single[k] for k in ("plain", "optimized", "no_grad_forwards")}, (name, paths)
        # ZeRO-3 fetches the head once per no-grad pass, not once per chunk
        fetches = paths["no_grad_forwards"] if name.startswith("zero3") else single["no_grad_head_calls"]
        assert paths["no_grad_head_calls"] == fetches, (name, paths)
        steps = fits[name]["steps"]
        assert [s["global_step"] for s in steps] == [0, 1, 1, 2], name
        assert steps[0]["loss"] is None, f"{name}: metrics published before the window's last micro-step"
        for got, want in zip(steps[1:], base[1:]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), name
            assert got["reward"] == want["reward"], name  # step 2 generated from the same weights
            # the engine's float64 norm of its flat buffers vs the module's float32 sum: ~1e-7 relative
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6), name
        # weights O(0.1), two SGD steps in another reduction order: float32 noise only
        assert fits[name]["export_diff"] < 1e-6, name
        assert fits[name]["export"] == fits["single_device"]["export"], name
    divides = fits["zero3_engine_divides"]["steps"]
    assert divides[1]["grad_norm"] == pytest.approx(base[1]["grad_norm"] / 2, rel=1e-6)
    assert fits["zero3_engine_divides"]["export_diff"] > 1e-3


@pytest.mark.slow
def test_zero3_on_two_ranks_trains_and_exports_like_ddp(tmp_path):
    """Lightning launching 2 ranks under ZeRO-3 (each rank holds half of every weight): the same
    rollouts, optimized log-prob forward, global gradient norm and exported weights as DDP."""
    from safetensors.torch import load_file

    from tests.e2e.test_strategies import run_strategy_child

    model_dir = make_model_dir(tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", num_rows=4)
    ddp = run_strategy_child("ddp", model_dir, prompts, tmp_path / "ddp", free_port())
    zero3 = run_strategy_child("zero3", model_dir, prompts, tmp_path / "zero3", free_port(), DS_ACCELERATOR="cpu")
    for rank in (0, 1):
        # each rank holds half of the weights (partitions padded to the world size)
        assert zero3[rank]["held_numel"] == pytest.approx(ddp[rank]["held_numel"] / 2, rel=0.01)
        assert set(zero3[rank]["lags"]) == {0} and len(zero3[rank]["lags"]) == 4 * 4
        assert zero3[rank]["paths"] == ddp[rank]["paths"] and zero3[rank]["paths"]["plain"] == 0, zero3[rank]["paths"]
        assert zero3[rank]["seeds"] == ddp[rank]["seeds"]
        # the engine's float64 norm of its flat partitions vs DDP's float32 sum: ~1e-6 relative
        assert zero3[rank]["grad_norms"] == pytest.approx(ddp[0]["grad_norms"], rel=1e-5)
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    exported_ddp = load_file(tmp_path / "ddp" / "final_model" / "model.safetensors")
    exported_zero3 = load_file(tmp_path / "zero3" / "final_model" / "model.safetensors")
    assert exported_zero3.keys() == exported_ddp.keys()
    assert max(float((exported_ddp[k] - initial[k]).abs().max()) for k in initial) > 1e-3, "the weights did not move"
    for key in exported_ddp:  # two SGD steps, gradients reduced in another order: float32 noise only
        torch.testing.assert_close(exported_zero3[key], exported_ddp[key], rtol=1e-5, atol=1e-6)

"""The module under Lightning's sharding strategy: FSDP2 (``ModelParallelStrategy``, 2 gloo
processes on CPU) trains exactly like DDP — same rollouts (lag 0), the same optimized log-prob
forward (chunked LM head, packing), same global gradient norm, and the exported model,
consolidated through the strategy, has the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port, make_model_dir, write_prompts

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("strategy_child.py")


def run_strategy_child(strategy: str, model_dir: str, prompts: str, out: Path, port: int, **env_extra: str) -> list[dict]:
    """The two ranks' results of ``strategy_child.py`` under ``strategy``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(port), **env_extra}
    result = subprocess.run([sys.executable, str(CHILD), strategy, model_dir, prompts, str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    missing = [rank for rank in (0, 1) if not (out / f"result_{rank}.json").exists()]
    assert not missing, f"rank(s) {missing} wrote no result; the ranks' stderr:\n{result.stderr[-6000:]}"
    return [json.loads((out / f"result_{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_fsdp2_trains_and_exports_like_ddp(tmp_path):
    from safetensors.torch import load_file

    model_dir = make_model_dir(tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", num_rows=4)  # 2 optimizer steps per epoch: 2 epochs
    ddp = run_strategy_child("ddp", model_dir, prompts, tmp_path / "ddp", free_port())
    fsdp2 = run_strategy_child("fsdp2", model_dir, prompts, tmp_path / "fsdp2", free_port())
    for rank in (0, 1):  # every rollout trained on at the step that generated it
        assert set(ddp[rank]["lags"]) == {0} and set(fsdp2[rank]["lags"]) == {0}
        # FSDP2 runs the chunked head and packing as the root module's forward, as DDP runs them
        assert fsdp2[rank]["paths"] == ddp[rank]["paths"] and fsdp2[rank]["paths"]["plain"] == 0, fsdp2[rank]["paths"]
        assert len(ddp[rank]["lags"]) == 4 * 4  # 4 steps x 4 rows on each rank
        assert fsdp2[rank]["held_numel"] == pytest.approx(ddp[rank]["held_numel"] / 2, rel=0.01)  # sharded
    seeds = [tuple(s) for rank in (0, 1) for s in ddp[rank]["seeds"]]
    triples = {s[1:4] for s in seeds}
    assert len(triples) == 2 * 2 * 2  # 2 ranks x 2 epochs x 2 generation batches
    assert len({s[4] for s in seeds}) == len(triples), "two (rank, epoch, generation) share a shuffle seed"
    # The norm of a sum of ~1e4 float32 squares reduced in two orders: relative error ~1e-6.
    assert fsdp2[0]["grad_norms"] == pytest.approx(ddp[0]["grad_norms"], rel=1e-5)
    assert fsdp2[1]["grad_norms"] == pytest.approx(ddp[0]["grad_norms"], rel=1e-5)  # global on every rank
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    exported_ddp = load_file(tmp_path / "ddp" / "final_model" / "model.safetensors")
    exported_fsdp2 = load_file(tmp_path / "fsdp2" / "final_model" / "model.safetensors")
    assert exported_fsdp2.keys() == exported_ddp.keys()
    moved = max(float((exported_ddp[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3, "training did not change the weights"
    for key in exported_ddp:  # weights O(1), two SGD steps: float32 reduction-order noise only
        torch.testing.assert_close(exported_fsdp2[key], exported_ddp[key], rtol=1e-5, atol=1e-6)

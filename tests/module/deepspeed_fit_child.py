"""Short fits of GRPOModule under GRPODeepSpeedStrategy on CPU, against the single-device run.

    MASTER_PORT=p python tests/module/deepspeed_fit_child.py <model_dir> <prompts> <out_dir>

``CPUDeepSpeed`` (``tests/cpu_deepspeed.py``) lifts Lightning's CUDA-only checks; the rest is the
real code. Every run: 2 optimizer steps of 2 accumulated micro-batches, the same seed.
Writes ``<out_dir>/fits.json``: per run, the step metrics seen by a callback on every micro-step,
how many log-prob forwards took the plain and the optimized path, how many times the no-grad ones
called the LM head module (ZeRO-3 fetches its weight at each call), and the exported weights'
largest difference from the single-device run's export.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from grpo_lightning.data import RolloutDataModule  # noqa: E402
from grpo_lightning.losses import DAPOLoss  # noqa: E402
from grpo_lightning.module import GRPOModule  # noqa: E402
from grpo_lightning.module import forward as forward_code  # noqa: E402
from grpo_lightning.module.forward_options import ForwardOptions  # noqa: E402
from grpo_lightning.types import GenerationParams  # noqa: E402
from tests.cpu_deepspeed import CPUDeepSpeed  # noqa: E402
from tests.helpers import count_forward_paths, length_reward  # noqa: E402

PATHS = count_forward_paths()
CHUNK_TOKENS = 4  # the LM head's chunk: a rollout batch's completions take several
NO_GRAD = {"forwards": 0, "head_calls": 0, "inside": False}
_optimized = forward_code._optimized_logprobs


def _counted_optimized(*args, **kwargs):
    if torch.is_grad_enabled():
        return _optimized(*args, **kwargs)
    NO_GRAD["forwards"] += 1
    NO_GRAD["inside"] = True
    try:
        return _optimized(*args, **kwargs)
    finally:
        NO_GRAD["inside"] = False


forward_code._optimized_logprobs = _counted_optimized


class CountHeadCalls(pl.Callback):
    """Counts the calls of the policy's and reference's LM head modules in no-grad log-prob passes."""

    def on_fit_start(self, trainer, pl_module):
        for model in (pl_module.policy, pl_module.ref_policy):
            if model is not None:
                model.get_output_embeddings().register_forward_pre_hook(self._count)

    @staticmethod
    def _count(module, inputs):
        NO_GRAD["head_calls"] += NO_GRAD["inside"]


class Record(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = {k: pl_module.step_metrics.get(k) for k in ("loss", "grad_norm", "reward")}
        self.steps.append({"global_step": trainer.global_step, **metrics})


def fit(strategy, model_dir: str, prompts: str, out: Path, beta: float) -> list[dict]:
    pl.seed_everything(3)
    loss = DAPOLoss(beta=beta)
    module = GRPOModule(model_dir, loss=loss, optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
                        lr_scheduler_type="constant", gradient_checkpointing=False, output_dir=str(out),
                        forward=ForwardOptions(lm_head_chunk_tokens=CHUNK_TOKENS))
    data = RolloutDataModule(prompts, reward_funcs=[length_reward], num_generations=4, per_device_train_batch_size=4,
                             generation=GenerationParams(max_completion_length=6))
    record = Record()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, strategy=strategy, logger=False,
                         accumulate_grad_batches=2, gradient_clip_val=1.0, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[record, CountHeadCalls()],
                         default_root_dir=str(out))
    before = {**PATHS, **NO_GRAD}
    trainer.fit(module, data)
    counts = {**PATHS, **{f"no_grad_{k}": NO_GRAD[k] for k in ("forwards", "head_calls")}}
    return record.steps, {k: v - before[k.removeprefix("no_grad_")] for k, v in counts.items()}


def main(model_dir: str, prompts: str, out_dir: str) -> None:
    out = Path(out_dir)
    runs = {
        "single_device": lambda: "auto",
        "zero3_gather": lambda: CPUDeepSpeed(stage=3, process_group_backend="gloo"),
        "zero3_sharded": lambda: CPUDeepSpeed(stage=3, process_group_backend="gloo", ds3_gather_for_generation=False),
        "zero2": lambda: CPUDeepSpeed(stage=2, process_group_backend="gloo"),
        "zero3_engine_divides": lambda: CPUDeepSpeed(stage=3, process_group_backend="gloo", engine_divides=True),
    }
    beta = float(os.environ.get("FIT_BETA", "0.04"))  # a reference model, partitioned like the policy
    result = {}
    for name, strategy in runs.items():
        steps, paths = fit(strategy(), model_dir, prompts, out / name, beta)
        exported = load_file(out / name / "final_model" / "model.safetensors")
        result[name] = {"steps": steps, "paths": paths, "export": {k: list(v.shape) for k, v in exported.items()},
                        "dtypes": sorted({str(v.dtype) for v in exported.values()})}
        if name != "single_device":
            base = load_file(out / "single_device" / "final_model" / "model.safetensors")
            result[name]["export_diff"] = max(float((exported[k] - base[k]).abs().max()) for k in base)
    initial = load_file(Path(model_dir) / "model.safetensors")
    base = load_file(out / "single_device" / "final_model" / "model.safetensors")
    result["moved"] = max(float((base[k] - initial[k]).abs().max()) for k in initial)
    (out / "fits.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])

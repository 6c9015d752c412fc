"""GPU smoke check of the training loop: run by scripts/gpu_check.sh on a CUDA machine.

1. The quickstart task on CUDA in bf16-mixed precision: the reward must rise; prints step time.
2. Every loss type (and beta != 0, i.e. a reference model) for 2 optimizer steps on CUDA: the
   loss is finite and every parameter changes.
3. A token-budget training pass (each micro-batch in parts, one backward each, under bf16
   autocast): it runs and updates every parameter.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grpo_lightning.data import RolloutDataModule  # noqa: E402
from grpo_lightning.losses import LOSSES  # noqa: E402
from grpo_lightning.module import GRPOModule  # noqa: E402
from grpo_lightning.module.forward_options import ForwardOptions  # noqa: E402
from grpo_lightning.types import GenerationParams  # noqa: E402

CUDA = torch.cuda.is_available()  # on CPU the script still runs (a dry run of the script itself)
MODEL = str(REPO / "examples/arithmetic/model")
DATA = str(REPO / "examples/arithmetic/train.jsonl")


class StepLog(pl.Callback):
    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.started = 0.0
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        assert batch.completion_ids.is_cuda == CUDA and batch.advantages.is_cuda == CUDA
        if batch.generation_metrics:
            self.rewards.append(batch.generation_metrics["reward"])
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if CUDA:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.started)


def _built(module):
    module.configure_model()
    return module


def fit(loss, max_steps, lr=5e-4, forward=ForwardOptions(), **data):
    precision = "bf16-mixed" if CUDA else "32-true"
    pl.seed_everything(0)
    module = GRPOModule(MODEL, loss=loss, learning_rate=lr, lr_scheduler_type="constant", save_final_model=False,
                        gradient_checkpointing=False, forward=forward)
    log = StepLog()
    trainer = pl.Trainer(max_steps=max_steps, accelerator="gpu" if CUDA else "cpu", devices=1, precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         gradient_clip_val=1.0, callbacks=[log])
    kwargs = dict(num_generations=8, per_device_train_batch_size=128, generation=GenerationParams(max_completion_length=5))
    kwargs.update(data)
    trainer.fit(module, RolloutDataModule(DATA, reward_funcs=["exact_match_reward"], **kwargs))
    return module, log


def main() -> None:
    report: dict = {"device": torch.cuda.get_device_name(0) if CUDA else "cpu", "torch": torch.__version__}
    module, log = fit("dapo", max_steps=150)
    first, last = sum(log.rewards[:10]) / 10, sum(log.rewards[-10:]) / 10
    report["quickstart_bf16"] = {"reward_first10": round(first, 3), "reward_last10": round(last, 3),
                                 "median_step_s": round(sorted(log.times)[len(log.times) // 2], 4)}
    print("quickstart:", json.dumps(report), flush=True)
    assert last > first + 0.2, report
    for name in sorted(LOSSES):
        kwargs = {"beta": 0.04}
        if name == "luspo":
            kwargs["importance_sampling_level"] = "sequence"
        module = _built(GRPOModule(MODEL, loss=LOSSES[name](**kwargs), save_final_model=False))
        before = [p.detach().clone() for p in module.policy.parameters()]
        module, log = fit(LOSSES[name](**kwargs), max_steps=2, lr=1e-2, per_device_train_batch_size=32,
                          steps_per_generation=2)
        changed = all(not torch.equal(b.to(p.device), p) for b, p in zip(before, module.policy.parameters()))
        ref_device = next(module.ref_policy.parameters()).device.type
        report[f"loss_{name}"] = {"all_params_changed": changed, "reference_on": ref_device}
        assert changed and ref_device == next(module.policy.parameters()).device.type, report
    before = [p.detach().clone() for p in _built(GRPOModule(MODEL, save_final_model=False)).policy.parameters()]
    module, log = fit("dapo", max_steps=2, lr=1e-2, forward=ForwardOptions(train_token_budget=256))
    changed = all(not torch.equal(b.to(p.device), p) for b, p in zip(before, module.policy.parameters()))
    report["train_token_budget"] = {"all_params_changed": changed, "median_step_s": round(sorted(log.times)[1], 4)}
    assert changed, report
    print("GPU_CHECK_REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()

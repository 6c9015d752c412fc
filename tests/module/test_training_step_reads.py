"""A training micro-step reads no device value of ours between its forward and its backward: the
loss and the loss-side metrics stay on the device until the optimizer step closes, where all
micro-steps are reduced across ranks and read at once. (On CUDA each read there would wait for the
forward to finish, and under DDP each collective for the slowest rank, once per micro-step.)

Counted on CPU with ``CountDeviceReads``: the policy's parameters and the batch are marked as on
the device from ``on_train_batch_start`` to ``on_before_backward``; the layout's one transfer of
the batch is ours, transformers' own reads are the model's. (``.tolist()`` of a CPU tensor does not
dispatch, so the fit test sees ``.item()``/``float()`` reads; that the metrics are not reduced or
read per micro-step is the second test's.)"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.metrics import TrainingMetrics, reduce_metric_values
from grpo_lightning.types import GenerationParams, MetricValue
from tests.helpers import length_reward, make_model_dir, write_prompts
from tests.module.test_forward_host_syncs import CountDeviceReads


class ReadsOfAMicroStep(pl.Callback):
    def __init__(self) -> None:
        self.mode: CountDeviceReads | None = None
        self.seen: list[tuple[int, dict]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        tensors = [*pl_module.policy.parameters(), batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                   batch.completion_mask, batch.advantages]
        self.mode = CountDeviceReads(*tensors)
        self.mode.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        self.mode.__exit__(None, None, None)
        self.seen.append(self.mode.ours())


def test_a_micro_step_reads_nothing_between_forward_and_backward(tmp_path):
    module = GRPOModule(make_model_dir(tmp_path / "model"), loss="dapo", learning_rate=1e-3,
                        gradient_checkpointing=False, save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl", num_rows=8), reward_funcs=[length_reward],
                             num_generations=4, per_device_train_batch_size=4,
                             generation=GenerationParams(max_completion_length=6))
    reads = ReadsOfAMicroStep()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[reads],
                         accumulate_grad_batches=2)
    trainer.fit(module, data)
    assert len(reads.seen) == 4  # 2 steps x 2 micro-steps
    assert all(seen == (1, {}) for seen in reads.seen), reads.seen  # the layout's transfer only
    assert math.isfinite(trainer.callback_metrics["loss"])


def _metrics(seed: int) -> dict[str, MetricValue]:
    g = torch.Generator().manual_seed(seed)
    return {"kl": MetricValue(torch.rand((), generator=g), torch.tensor(3.0)),
            "clip_ratio/low_min": MetricValue(torch.rand((), generator=g), torch.tensor(1.0), "min")}


def test_micro_steps_are_reduced_at_the_step_end_in_one_collective_per_op():
    calls: list[str] = []

    def all_reduce(tensor, op):  # two ranks with the same values
        calls.append(op)
        return tensor * 2 if op == "sum" else tensor

    metrics = TrainingMetrics()
    for seed in range(3):
        metrics.add_micro_step(_metrics(seed), all_reduce)
    assert calls == []  # nothing read or reduced per micro-step
    step = metrics.close_step({"grad_norm": 1.0})
    assert sorted(calls) == ["min", "sum"]
    expected = [reduce_metric_values(_metrics(seed), all_reduce) for seed in range(3)]
    for name in ("kl", "clip_ratio/low_min"):
        assert step[name] == sum(e[name] for e in expected) / 3
    assert metrics.flush_log()["kl"] == step["kl"]

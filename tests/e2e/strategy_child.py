"""One short fit under a named strategy, for the multi-process tests (run as a script).

    python tests/e2e/strategy_child.py <ddp|fsdp2|zero3> <model_dir> <prompts> <out_dir>

``zero3``: DeepSpeed ZeRO-3 on its CPU accelerator (``DS_ACCELERATOR=cpu``, ``tests/cpu_deepspeed.py``).

Each rank writes ``<out_dir>/result_<rank>.json`` (per-step grad norms, the lag of every rollout
it trained on, the micro-batch shuffle seed of each (rank, epoch, generation) it built, and how
many log-prob forwards took the plain and the optimized path); the
policy is exported to ``<out_dir>/final_model`` through the strategy.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import grpo_lightning.data.datamodule as datamodule_code  # noqa: E402
from grpo_lightning.data import RolloutDataModule  # noqa: E402
from grpo_lightning.module import GRPOModule  # noqa: E402
from grpo_lightning.types import GenerationParams  # noqa: E402
from tests.helpers import count_forward_paths, length_reward  # noqa: E402


class Record(pl.Callback):
    def __init__(self) -> None:
        self.grad_norms: list[float] = []
        self.lags: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lags += (trainer.global_step - batch.policy_versions).tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.grad_norms.append(pl_module.step_metrics["grad_norm"])


SEEDS: list[tuple[int, int, int, int, int]] = []  # (seed, rank, epoch, generation) -> shuffle seed
_shuffle_seed = datamodule_code.shuffle_seed


def recording_shuffle_seed(seed: int, rank: int, epoch: int, generation: int) -> int:
    value = _shuffle_seed(seed, rank, epoch, generation)
    SEEDS.append((seed, rank, epoch, generation, value))
    return value


datamodule_code.shuffle_seed = recording_shuffle_seed

PATHS = count_forward_paths()  # which log-prob forward ran (FSDP2 keeps the optimized one)


def held_numel(model: torch.nn.Module) -> int:
    """The parameter elements this rank holds: its ZeRO-3 partitions, or FSDP2's local shards."""
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            total += p.ds_tensor.numel()
        else:
            total += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return total


def main(strategy_name: str, model_dir: str, prompts: str, out_dir: str) -> None:
    pl.seed_everything(3)
    if strategy_name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False)
    elif strategy_name == "zero3":
        from tests.cpu_deepspeed import CPUDeepSpeed

        strategy = CPUDeepSpeed(stage=3, process_group_backend="gloo")
    else:
        strategy = strategy_name
    module = GRPOModule(model_dir, loss="dapo", optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
                        lr_scheduler_type="constant", gradient_checkpointing=False, output_dir=out_dir)
    data = RolloutDataModule(prompts, reward_funcs=[length_reward], num_generations=4, per_device_train_batch_size=4,
                             generation=GenerationParams(max_completion_length=6))
    record = Record()
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         gradient_clip_val=1.0, callbacks=[record], default_root_dir=out_dir)
    trainer.fit(module, data)
    assert Path(out_dir, "final_model", "config.json").exists(), "fit returned before rank 0 exported the model"
    result = {"grad_norms": record.grad_norms, "lags": record.lags, "seeds": SEEDS, "paths": PATHS,
              "held_numel": held_numel(module.policy)}
    Path(out_dir, f"result_{trainer.global_rank}.json").write_text(json.dumps(result))
    trainer.strategy.barrier("results written")  # no rank tears the group down under a peer's message


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a rank that aborts shows where (the test prints stderr)
    main(*sys.argv[1:])

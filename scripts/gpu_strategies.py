"""Each GPU strategy recipe (configs/strategy/) for a few optimizer steps on one GPU, bf16.

Run by ``scripts/gpu_check.sh`` (section ``strategies``); each run is its own process (a fresh
CUDA context, process group and memory peak):

    single          no strategy (Lightning's single-device), bf16-mixed: the baseline
    fsdp            configs/strategy/fsdp.yaml
    zero2           configs/strategy/deepspeed_zero2.yaml
    zero3           configs/strategy/deepspeed_zero3.yaml (ds3_gather_for_generation: true)
    zero3_sharded   the same with ds3_gather_for_generation: false

The model is a random Llama (hidden 1024, 12 layers, ~150M parameters) with the arithmetic
example's tokenizer, so the numbers are about the strategies, not the task: the reward is the
number of distinct characters of a completion, which varies between samples (non-zero advantages
and gradients). A reference model (beta 0.04) is built too: ZeRO-3 partitions it like the policy.
Every run: 2 micro-batches of 64 rows per optimizer step, 32-token completions. Printed per run:
median step time (steps after the first), peak CUDA memory, the last step's loss, reward and
grad_norm, and whether the exported final_model loads with AutoModelForCausalLM with every
parameter of the policy and weights that moved. Writes ``strategies_cuda.json`` to --out-dir.

    python scripts/gpu_strategies.py [--runs single,fsdp,...] [--steps 4] [--out-dir DIR]
    python scripts/gpu_strategies.py --dry-run    # CPU: the single run of a tiny model, 2 steps

The strategy recipes are read with PyYAML and their class_paths instantiated here (the GPU image
has no jsonargparse; the CLI's reading of the same files is tested in tests/module/test_strategies.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECIPES = {"fsdp": "fsdp", "zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3", "zero3_sharded": "deepspeed_zero3"}
RUNS = ["single", "fsdp", "zero2", "zero3", "zero3_sharded"]
DATA = REPO / "examples/arithmetic/train.jsonl"


def distinct_characters(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward that varies between samples of a random model (so advantages and gradients are not 0)."""
    return [float(len(set(c))) for c in completions]


def instantiate(node: Any) -> Any:
    """A YAML ``{class_path, init_args}`` tree as objects (what LightningCLI does with it)."""
    if isinstance(node, dict) and "class_path" in node:
        module, _, name = node["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return cls(**{k: instantiate(v) for k, v in (node.get("init_args") or {}).items()})
    return node


def make_model(path: Path, tiny: bool) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples/arithmetic/model")
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2) \
        if tiny else dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                          num_key_value_heads=8)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=128, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **size)
    import torch

    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def child(run: str, model_dir: str, out: Path, steps: int, device: str) -> dict:
    import lightning.pytorch as pl
    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.losses import DAPOLoss
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams

    cuda = device == "cuda"
    if run == "single":
        strategy, precision = "auto", "bf16-mixed" if cuda else "32-true"
    else:
        trainer_cfg = yaml.safe_load((REPO / "configs/strategy" / f"{RECIPES[run]}.yaml").read_text())["trainer"]
        if run == "zero3_sharded":
            trainer_cfg["strategy"]["init_args"]["ds3_gather_for_generation"] = False
        strategy, precision = instantiate(trainer_cfg["strategy"]), trainer_cfg["precision"]

    class Steps(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = time.perf_counter()
            self.seen = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step > self.seen:  # an optimizer step ended
                if cuda:
                    torch.cuda.synchronize()
                now = time.perf_counter()
                self.times.append(now - self.last)
                self.last, self.seen = now, trainer.global_step

    pl.seed_everything(0)
    module = GRPOModule(model_dir, loss=DAPOLoss(beta=0.04), learning_rate=1e-5, lr_scheduler_type="constant",
                        gradient_checkpointing=True, output_dir=str(out))
    data = RolloutDataModule(str(DATA), reward_funcs=[distinct_characters], num_generations=8,
                             per_device_train_batch_size=64, steps_per_generation=2,
                             generation=GenerationParams(max_completion_length=32))
    record = Steps()
    trainer = pl.Trainer(max_steps=steps, accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy,
                         precision=precision, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[record], default_root_dir=str(out))
    started = time.perf_counter()
    trainer.fit(module, data)
    result: dict[str, Any] = {
        "run": run, "strategy": type(trainer.strategy).__name__, "precision": precision, "steps": trainer.global_step,
        "wall_s": round(time.perf_counter() - started, 1),
        "median_step_s": round(statistics.median(record.times[1:] or record.times), 3),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        **{k: round(float(module.step_metrics[k]), 5) for k in ("loss", "reward", "grad_norm")},
    }
    if trainer.is_global_zero:
        exported = AutoModelForCausalLM.from_pretrained(out / "final_model")
        initial = AutoModelForCausalLM.from_pretrained(model_dir)
        result["export_loads"] = True
        result["export_dtype"] = str(next(exported.parameters()).dtype)
        result["export_params_equal"] = exported.state_dict().keys() == initial.state_dict().keys() and all(
            exported.state_dict()[k].shape == v.shape for k, v in initial.state_dict().items())
        result["export_moved"] = max(float((exported.state_dict()[k].float() - v).abs().max())
                                     for k, v in initial.state_dict().items())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out-dir", default=os.environ.get("BENCH_OUT_DIR", "benchmarks/results"))
    parser.add_argument("--timeout", type=int, default=150, help="seconds per run")
    parser.add_argument("--dry-run", action="store_true", help="CPU: the single run of a tiny model, 2 steps")
    parser.add_argument("--child", nargs=4, metavar=("RUN", "MODEL", "OUT", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run, model, out, device = args.child
        print("RESULT " + json.dumps(child(run, model, Path(out), args.steps, device)), flush=True)
        return
    runs = ["single"] if args.dry_run else args.runs.split(",")
    steps, device = (2, "cpu") if args.dry_run else (args.steps, "cuda")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", tiny=args.dry_run)
        for run in runs:
            if run.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
                results.append({"run": run, "skipped": "deepspeed is not installed (carry its wheels: gpu_check.sh)"})
                print(f"== {run}: skipped, DeepSpeed is not installed", flush=True)
                continue
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(29500 + len(results))}
            cmd = [sys.executable, __file__, "--steps", str(steps), "--child", run, model, str(Path(tmp) / run), device]
            print(f"== {run}", flush=True)
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                results.append({"run": run, "failed": f"timed out after {args.timeout} s"})
                print(f"   FAILED: timed out after {args.timeout} s", flush=True)
                continue
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                results.append({"run": run, "failed": (proc.stderr or proc.stdout)[-1500:]})
                print(f"   FAILED (rc {proc.returncode}):\n{(proc.stderr or proc.stdout)[-1500:]}", flush=True)
                continue
            results.append(json.loads(lines[-1][len("RESULT "):]))
            print("   " + json.dumps(results[-1]), flush=True)
    header = f"{'run':<14}{'strategy':<24}{'step s':>8}{'peak GiB':>10}{'loss':>11}{'reward':>8}{'grad_norm':>11}  export"
    print(header)
    for r in results:
        if "steps" not in r:
            print(f"{r['run']:<14}{r.get('skipped') or 'FAILED'}")
            continue
        export = "ok" if r.get("export_params_equal") and r.get("export_moved", 0) > 0 else "BAD"
        print(f"{r['run']:<14}{r['strategy']:<24}{r['median_step_s']:>8}{str(r['peak_mem_gib']):>10}{r['loss']:>11.5f}"
              f"{r['reward']:>8.3f}{r['grad_norm']:>11.4f}  {export} ({r.get('export_dtype')})")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    name = "strategies_cpu_dry_run.json" if args.dry_run else "strategies_cuda.json"
    (Path(args.out_dir) / name).write_text(json.dumps(results, indent=1))
    if any("failed" in r for r in results):
        print("STRATEGY CHECK FAILED")
        sys.exit(1)


if __name__ == "__main__":
    main()

"""A learning curve on one GPU from local files only (issue #15 item 4; ``gpu_check.sh`` section ``learn``).

The task is the repository's two-digit addition (``examples/arithmetic``: 4,000 training and 500
held-out prompts ``"a+b="`` with their answers) and the policy its 2-layer character Llama, warm
started to be partly right (``examples/arithmetic/model``). GRPO with ``exact_match_reward``
trains it as ``configs/gpu/arithmetic_learn.yaml`` says (bf16-mixed, 64 prompts × 8 completions a
step); every ``--eval-every`` steps the policy answers all 500 held-out prompts (4 answers
sampled at temperature 1, as GRPO samples them, and the greedy one) and both exact-match
accuracies are recorded, with the training reward of every step. The warm start is already
right greedily on most prompts (0.97), not when sampling (0.29): GRPO sharpens the sampled
distribution, so the sampled accuracy is the curve that rises. The GSM8K set is not
used: no model the GPU machine holds can do grade-school maths (``models/stories260K`` writes
stories), so its accuracy would stay at 0.

    python scripts/gpu/learn.py --out $OUT/learn.json              # GPU, about 2 minutes
    python scripts/gpu/learn.py --tiny --out /tmp/learn.json       # CPU dry run (a few steps, 64 test prompts)
    python scripts/gpu/learn.py --plot docs/learning_curve_gpu.png --from-json learn.json   # the PNG (needs matplotlib)

Uses the Python API (no jsonargparse/mlflow: the GPU image lacks them); ``grpo fit --config
configs/gpu/arithmetic_learn.yaml`` runs the same recipe through the CLI (its ``eval_reward`` is
the sampled, not greedy, accuracy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

MODEL = REPO / "examples/arithmetic/model"
TRAIN = REPO / "examples/arithmetic/train.jsonl"
TEST = REPO / "examples/arithmetic/test.jsonl"


def accuracy(policy, tokenizer, rows: list[dict], device, *, samples: int = 0, batch: int = 512) -> float:
    """Exact-match accuracy of 5-token answers to ``rows`` (``prompt``/``answer``): greedy
    (``samples=0``) or the mean over ``samples`` answers sampled at temperature 1 (seeded)."""
    import torch

    from grpo_lightning.rewards.exact_match import exact_match_reward

    was_training = policy.training
    policy.eval()
    correct = 0.0
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            part = rows[start : start + batch]
            enc = tokenizer([r["prompt"] for r in part], return_tensors="pt", padding=True).to(device)
            kwargs = dict(do_sample=False)
            if samples:
                torch.manual_seed(1234 + start)  # the same draws at every evaluation
                kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=samples)
            out = policy.generate(**enc, max_new_tokens=5, pad_token_id=tokenizer.pad_token_id, **kwargs)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            answers = [r["answer"] for r in part for _ in range(max(samples, 1))]
            correct += sum(exact_match_reward(texts, answers))
    policy.train(was_training)
    return correct / (len(rows) * max(samples, 1))


def run(args: argparse.Namespace) -> dict:
    import lightning.pytorch as pl
    import torch

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams

    cuda = torch.cuda.is_available() and not args.tiny
    test_rows = [json.loads(line) for line in TEST.read_text().splitlines() if line.strip()]
    if args.tiny:
        test_rows = test_rows[:64]
    started = time.perf_counter()
    curve: dict = {"step": [], "sampled_accuracy": [], "greedy_accuracy": [], "train_step": [], "train_reward": [],
                   "step_s": []}

    class Curve(pl.Callback):
        def _evaluate(self, trainer, module):
            sampled = accuracy(module.policy, module.tokenizer, test_rows, module.device, samples=4)
            greedy = accuracy(module.policy, module.tokenizer, test_rows, module.device)
            curve["step"].append(trainer.global_step)
            curve["sampled_accuracy"].append(sampled)
            curve["greedy_accuracy"].append(greedy)
            print(f"[learn] step {trainer.global_step:4d}  held-out accuracy: sampled {sampled:.3f}, greedy {greedy:.3f}",
                  flush=True)

        def on_train_start(self, trainer, module):
            self._evaluate(trainer, module)

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.started = time.perf_counter()
            if batch.generation_metrics:
                curve["train_step"].append(trainer.global_step + 1)
                curve["train_reward"].append(float(batch.generation_metrics["reward"]))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            curve["step_s"].append(time.perf_counter() - self.started)
            out_of_time = args.max_seconds is not None and time.perf_counter() - started > args.max_seconds
            if out_of_time:  # end here, evaluated, so the JSON and plot are still written
                trainer.should_stop = True
            if trainer.global_step % args.eval_every == 0 or trainer.global_step == args.steps or out_of_time:
                self._evaluate(trainer, module)

    pl.seed_everything(42)
    module = GRPOModule(str(MODEL), loss="dapo", learning_rate=args.lr, lr_scheduler_type="constant",
                        gradient_checkpointing=False, save_final_model=False)
    data = RolloutDataModule(
        str(TRAIN), reward_funcs=["exact_match_reward"], num_generations=8,
        per_device_train_batch_size=8 * args.prompts_per_step, seed=42,
        generation=GenerationParams(max_completion_length=5, temperature=1.0),
    )
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="gpu" if cuda else "cpu", devices=1,
        precision="bf16-mixed" if cuda else "32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0, callbacks=[Curve()],
        default_root_dir=str(Path(args.out).parent / "learn_run"),
    )
    trainer.fit(module, data)
    steps_s = sorted(curve["step_s"])
    return {
        "task": "examples/arithmetic two-digit addition; 500 held-out prompts, exact match of 4 answers sampled "
                "at temperature 1 (sampled_accuracy) and of the greedy answer",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__, "steps": args.steps, "prompts_per_step": args.prompts_per_step,
        "num_generations": 8, "learning_rate": args.lr, "precision": "bf16-mixed" if cuda else "32-true",
        "wall_s": round(time.perf_counter() - started, 1),
        "median_step_s": round(steps_s[len(steps_s) // 2], 4) if steps_s else None,
        "curve": curve,
    }


def plot(result: dict, output: Path) -> None:
    """Held-out greedy accuracy and the training reward against optimizer steps."""
    from grpo_lightning.utils.curves import Panel, Series, draw_curves

    c = result["curve"]
    series = {
        "held-out sampled accuracy": Series("held-out sampled accuracy", tuple(c["step"]), tuple(c["sampled_accuracy"])),
        "held-out greedy accuracy": Series("held-out greedy accuracy", tuple(c["step"]), tuple(c["greedy_accuracy"])),
        "train reward (sampled)": Series("train reward (sampled)", tuple(c["train_step"]), tuple(c["train_reward"])),
    }
    panels = [Panel("two-digit addition", tuple(series))]
    title = f"GRPO on {result['device']} ({result['precision']})\n{result['prompts_per_step']} prompts x {result['num_generations']} completions a step"
    draw_curves(panels, series, str(output), title=title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts-per-step", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop (evaluated, results written) once training has run this long")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: 6 steps of 4 prompts, 64 test prompts")
    parser.add_argument("--out", default="benchmarks/results/learn_cuda.json")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the curve to this PNG")
    parser.add_argument("--from-json", type=Path, default=None, help="plot this result instead of training")
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.prompts_per_step, args.eval_every = 6, 4, 3
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        result = run(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        acc = result["curve"]["sampled_accuracy"]
        print(f"[learn] held-out sampled accuracy {acc[0]:.3f} -> {acc[-1]:.3f} in {result['wall_s']} s; wrote {args.out}")
    if args.plot:
        try:
            plot(result, args.plot)
            print(f"[learn] wrote {args.plot}")
        except ImportError as err:  # matplotlib missing on the machine: plot the JSON elsewhere
            print(f"[learn] no plot ({err}); run with --from-json {args.out} --plot ... where matplotlib is installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One benchmark run in its own process: our trainer or TRL's GRPOTrainer, instrumented.

    python benchmarks/bench_child.py --impl ours|trl --spec spec.json --out result.json

``spec.json`` (written by compare_trl.py) holds the shared settings. The run writes per-step wall
times, the time spent in each phase of the step, the tokens processed and the peak memory.

Step boundaries are the same on both sides: the end of one optimizer step to the end of the next
(Lightning ``on_train_batch_end`` / HF ``on_step_end``), so everything between two optimizer
steps (generation, scoring, Lightning or HF Trainer bookkeeping) is inside a step. Phases:

* ``generation``  ours: ``sampler.generate``; TRL: ``_generate_single_turn`` (padding + HF
  ``generate`` + EOS cut; TRL's prompt tokenization and length metrics are in ``other``).
* ``reward``      ours: ``RewardRunner.score``; TRL: ``_calculate_rewards``.
* ``logprob``     no-grad old/reference log-prob passes. Ours: ``rollout_logprobs``; TRL: the
  ``_get_per_token_logps_and_entropies`` calls made inside ``_generate_and_score_completions``.
* ``forward``     the training forward + loss. Ours: ``training_step``; TRL: ``compute_loss``.
* ``backward``    ours: ``on_before_backward`` to ``on_after_backward``; TRL: the rest of
  ``Trainer.training_step`` after ``_prepare_inputs`` and ``compute_loss`` (``accelerator.backward``).
* ``optimizer``   gradient-norm/clipping + optimizer + LR scheduler + zero-grad. Ours:
  ``on_before_optimizer_step`` to ``on_train_batch_end``; TRL: end of ``training_step`` to ``on_step_end``.
* ``other``       the step time minus the phases above.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import torch  # noqa: E402

import bench_assets  # noqa: E402
from rss_watch import RssWatch, describe  # noqa: E402

PHASES = ("generation", "reward", "logprob", "forward", "backward", "optimizer")


def peak_rss_mb() -> float:
    """``ru_maxrss`` of this process in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Recorder:
    """Accumulates phase times and token counts between two step boundaries."""

    def __init__(self, device: str, seed: int) -> None:
        self.cuda = device == "cuda"
        self.seed = seed
        self.generation_calls = 0
        self.last_cpu = None
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict] = []
        self.last_boundary = None
        self.rss_train_start = None
        self.peak_rss_train_start = None
        # Names the code on the way to the host-memory peak (issue 15: 9.8 GB vs TRL's 2.9 GB).
        self.watch = RssWatch().start()

    def enter(self, phase: str) -> None:
        """The phase the memory watcher files its samples under (``other`` between phases)."""
        self.watch.phase = phase

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        start = self.now()
        self.enter(name)
        try:
            yield
        finally:
            self.current[name] += self.now() - start
            self.note_rss(name)
            self.enter("other")

    def add(self, name: str, value: float) -> None:
        self.current[name] += value
        if name in PHASES:
            self.note_rss(name)
            self.enter("other")

    def note_rss(self, phase: str) -> None:
        """Resident memory right after a phase (max over the step): shows which phase grows it."""
        key = f"rss_after_{phase}_mb"
        self.current[key] = max(self.current.get(key, 0.0), rss_mb())
        # The process's peak so far (ru_maxrss only grows): the phase whose value jumps is the one
        # that reached the peak, even when the memory is freed again before the phase ends.
        self.current[f"peak_rss_after_{phase}_mb"] = peak_rss_mb()

    def time_generate_calls(self, model: torch.nn.Module) -> None:
        """Time each ``model.generate`` call itself (synchronised) and count its decode steps, on
        both sides alike: ``hf_generate_s`` against the ``generation`` phase separates the HF loop
        from what a trainer does around it; per decode step it compares the loops' speed."""
        original = model.generate

        def timed(*args, **kwargs):
            start = self.now()
            out = original(*args, **kwargs)
            self.current["hf_generate_s"] += self.now() - start
            sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
            prompt = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(sequences, torch.Tensor) and isinstance(prompt, torch.Tensor):
                self.current["decode_steps"] += sequences.shape[1] - prompt.shape[1]
            return out

        model.generate = timed

    def _gc_timer(self, phase: str, info: dict) -> None:
        """``gc.callbacks``: the seconds the cyclic garbage collector runs, per step (a full
        collection in a large process can take a good part of a second)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif getattr(self, "_gc_started", None) is not None:
            self.current["gc_s"] += time.perf_counter() - self._gc_started
            self._gc_started = None

    def train_start(self) -> None:
        gc.callbacks.append(self._gc_timer)
        self.rss_train_start = rss_mb()
        self.peak_rss_train_start = peak_rss_mb()  # includes the model load
        self.enter("other")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.last_boundary = self.now()
        self.last_cpu = time.process_time()

    def step_end(self, extra: dict | None = None) -> None:
        t, cpu = self.now(), time.process_time()
        step = {"step_time": t - self.last_boundary, **{p: self.current.get(p, 0.0) for p in PHASES}}
        # CPU seconds of this process per wall second: well below the thread count when other
        # processes take the cores (a contended step); kept to judge the numbers.
        step["cpu_util"] = (cpu - self.last_cpu) / step["step_time"]
        for key in ("prompt_tokens", "completion_tokens", "rows", "truncated", "max_completion", "hf_generate_s",
                    "decode_steps", "gc_s"):
            step[key] = self.current.get(key, 0.0)
        step.update({k: v for k, v in self.current.items() if k.startswith(("rss_after_", "peak_rss_after_"))})
        step["other"] = step["step_time"] - sum(step[p] for p in PHASES)
        step.update(extra or {})
        self.steps.append(step)
        print(f"[step {len(self.steps)}] " + ", ".join(
            f"{k} {v:.3f}" for k, v in step.items() if k in ("step_time", *PHASES, "other", "cpu_util"))
            + "; RSS MB after " + ", ".join(f"{k[10:-3]} {v:.0f}" for k, v in step.items() if k.startswith("rss_after_")),
            flush=True)
        self.current = defaultdict(float)
        self.last_boundary, self.last_cpu = t, cpu

    def reseed_for_generation(self) -> None:
        """Seed the global RNG identically on both sides before each generation call, so that both
        trainers sample the same completions from the same prompts and (nearly) the same weights."""
        torch.manual_seed(self.seed + 7919 * self.generation_calls)
        self.generation_calls += 1

    def count_tokens(self, prompt_lengths, completion_lengths, truncated) -> None:
        self.add("prompt_tokens", float(sum(prompt_lengths)))
        self.add("completion_tokens", float(sum(completion_lengths)))
        self.add("rows", float(len(completion_lengths)))
        self.add("truncated", float(sum(truncated)))
        self.current["max_completion"] = max(self.current.get("max_completion", 0.0), float(max(completion_lengths)))


# ------------------------------------------------------------------------------------ ours
def run_ours(spec: dict, rec: Recorder, plain: bool = False) -> dict:
    """Our trainer with its defaults; ``plain``: with ``ForwardOptions.plain()`` (the padded
    full-logits forward the speedups are checked against), to measure what they bring."""
    import lightning.pytorch as pl

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams

    class TimedGRPOModule(GRPOModule):
        def training_step(self, batch, batch_idx):
            with rec.phase("forward"):
                return super().training_step(batch, batch_idx)

        def rollout_logprobs(self, batch, *, reference, chunk_size):
            with rec.phase("logprob"):
                return super().rollout_logprobs(batch, reference=reference, chunk_size=chunk_size)

    class Timers(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            rec.time_generate_calls(pl_module.policy)
            rec.train_start()

        def on_before_backward(self, trainer, pl_module, loss):
            self._bwd = rec.now()
            rec.enter("backward")

        def on_after_backward(self, trainer, pl_module):
            rec.add("backward", rec.now() - self._bwd)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self._opt = rec.now()
            rec.enter("optimizer")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rec.add("optimizer", rec.now() - self._opt)
            rec.step_end()

        # The module logs a step's loss/reward in its own on_train_batch_end, after the callbacks':
        # pick them up at the next step's start (or at the end) for the step just finished.
        def _logged(self, trainer):
            if rec.steps:
                rec.steps[-1].update({f"logged_{k}": float(v) for k, v in trainer.callback_metrics.items()
                                      if k in ("loss", "reward")})

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._logged(trainer)

        def on_train_end(self, trainer, pl_module):
            self._logged(trainer)

    pl.seed_everything(spec["seed"], verbose=False)
    cuda = spec["device"] == "cuda"
    from grpo_lightning.losses import get_loss

    from grpo_lightning.module.forward import ForwardOptions

    extra = {"forward": ForwardOptions.plain() if plain else ForwardOptions(
        attention_kernel=spec.get("attention_kernel", "auto"))}
    module = TimedGRPOModule(
        spec["model_dir"], loss=get_loss(spec["loss_type"], beta=spec["beta"]), learning_rate=spec["learning_rate"],
        lr_scheduler_type="linear", gradient_checkpointing=spec["gradient_checkpointing"], save_final_model=False,
        **extra,
    )
    importance = {}
    if spec.get("importance_sampling", "default") == "off":
        from grpo_lightning.algo.importance import ImportanceSamplingCorrection

        importance["importance_sampling"] = ImportanceSamplingCorrection(enabled=False)
    datamodule = RolloutDataModule(
        spec["prompts_file"], reward_funcs=[bench_assets.first_token_parity_reward],
        num_generations=spec["num_generations"], per_device_train_batch_size=spec["per_device_train_batch_size"],
        seed=spec["seed"], generation=GenerationParams(max_completion_length=spec["max_completion_length"], temperature=1.0,
                                                   generation_kwargs=spec.get("generation_kwargs")),
        sampler=spec.get("sampler", "hf_generate"), **importance,
    )
    sampler_generate = datamodule.sampler.generate
    eos = module.tokenizer.eos_token_id

    def timed_generate(prompts, num_generations, params):
        rec.reseed_for_generation()
        with rec.phase("generation"):
            rollouts = sampler_generate(prompts, num_generations, params)
        rec.count_tokens([len(r.prompt_ids) for r in rollouts], [len(r.completion_ids) for r in rollouts],
                         [not r.ended_on_eos for r in rollouts])
        return rollouts

    datamodule.sampler.generate = timed_generate
    score = datamodule.rewards.score

    def timed_score(*args, **kwargs):
        with rec.phase("reward"):
            return score(*args, **kwargs)

    datamodule.rewards.score = timed_score
    trainer = pl.Trainer(
        max_steps=spec["max_steps"], accelerator="gpu" if cuda else "cpu", devices=1,
        precision="bf16-mixed" if spec.get("bf16", cuda) else "32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=spec["max_grad_norm"],
        log_every_n_steps=1, callbacks=[Timers()], default_root_dir=spec["work_dir"],
    )
    trainer.fit(module, datamodule)
    optimizer = trainer.optimizers[0]
    return {
        "forward_options": repr(getattr(module, "forward_options", None)),
        "sampler": type(datamodule.sampler).__name__,
        "param_dtype": str(next(module.policy.parameters()).dtype),
        "optimizer": f"{type(optimizer).__name__}({', '.join(f'{k}={optimizer.defaults.get(k)}' for k in ('foreach', 'fused'))})",
        "gradient_checkpointing": bool(getattr(module.policy, "is_gradient_checkpointing", None)),
        "eos_token_id": eos,
        "steps_done": trainer.global_step,
    }


# ------------------------------------------------------------------------------------- TRL
def run_trl(spec: dict, rec: Recorder) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    state = {"in_prepare": False, "training_step_end": None}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            rec.reseed_for_generation()
            with rec.phase("generation"):
                return super()._generate_single_turn(*args, **kwargs)

        def _generate(self, prompts):
            out = super()._generate(prompts)
            prompt_ids, completion_ids = out[0], out[1]
            ends = set(self.eos_token_ids)
            rec.count_tokens([len(p) for p in prompt_ids], [len(c) for c in completion_ids],
                             [not c or c[-1] not in ends for c in completion_ids])
            return out

        def _calculate_rewards(self, *args, **kwargs):
            with rec.phase("reward"):
                return super()._calculate_rewards(*args, **kwargs)

        def _generate_and_score_completions(self, *args, **kwargs):
            state["in_prepare"] = True
            try:
                return super()._generate_and_score_completions(*args, **kwargs)
            finally:
                state["in_prepare"] = False

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if not state["in_prepare"]:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with rec.phase("logprob"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def _prepare_inputs(self, *args, **kwargs):
            start = rec.now()
            try:
                return super()._prepare_inputs(*args, **kwargs)
            finally:
                state["prepare"] = state.get("prepare", 0.0) + rec.now() - start

        def compute_loss(self, *args, **kwargs):
            start = rec.now()
            try:
                return super().compute_loss(*args, **kwargs)
            finally:
                state["compute_loss"] = state.get("compute_loss", 0.0) + rec.now() - start

        def training_step(self, *args, **kwargs):
            state["prepare"], state["compute_loss"] = 0.0, 0.0
            start = rec.now()
            rec.enter("forward+backward")
            out = super().training_step(*args, **kwargs)
            end = rec.now()
            rec.enter("optimizer")
            rec.add("forward", state["compute_loss"])
            rec.add("backward", end - start - state["prepare"] - state["compute_loss"])
            state["training_step_end"] = end
            return out

    class Timers(TrainerCallback):
        def on_train_begin(self, args, state_, control, **kwargs):
            rec.time_generate_calls(kwargs["model"])  # the model TRL's generation unwraps to
            rec.train_start()

        def on_step_end(self, args, state_, control, **kwargs):
            rec.add("optimizer", rec.now() - state["training_step_end"])
            rec.step_end()

        def on_log(self, args, state_, control, logs=None, **kwargs):
            if rec.steps and logs:
                rec.steps[-1].update({f"logged_{k}": float(logs[k]) for k in ("loss", "reward") if k in logs})

    cuda = spec["device"] == "cuda"
    with open(spec["prompts_file"]) as f:
        dataset = Dataset.from_list([json.loads(line) for line in f])
    args = GRPOConfig(
        output_dir=spec["work_dir"], per_device_train_batch_size=spec["per_device_train_batch_size"],
        gradient_accumulation_steps=1, num_generations=spec["num_generations"],
        max_completion_length=spec["max_completion_length"], temperature=1.0, learning_rate=spec["learning_rate"],
        lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=spec["max_grad_norm"], max_steps=spec["max_steps"],
        beta=spec["beta"], loss_type=spec["loss_type"], gradient_checkpointing=spec["gradient_checkpointing"],
        bf16=spec.get("bf16", cuda), fp16=False, use_cpu=not cuda, seed=spec["seed"], data_seed=spec["seed"], logging_steps=1,
        save_strategy="no", report_to="none", dataloader_num_workers=0, disable_tqdm=True,
        use_transformers_continuous_batching=spec.get("trl_generation", "generate") == "continuous_batching",
    )
    trainer = TimedGRPOTrainer(
        model=spec["model_dir"], reward_funcs=[bench_assets.first_token_parity_reward], args=args, train_dataset=dataset,
        callbacks=[Timers()],
    )
    trainer.train()
    optimizer = trainer.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    return {
        "param_dtype": str(next(trainer.model.parameters()).dtype),
        "optimizer": f"{type(inner).__name__}({', '.join(f'{k}={inner.defaults.get(k)}' for k in ('foreach', 'fused'))})",
        "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", None)),
        "eos_token_id": trainer.eos_token_ids,
        "steps_done": trainer.state.global_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("ours", "ours_plain", "trl"), required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    spec = json.loads(Path(cli.spec).read_text())
    started = time.perf_counter()
    probe = bench_assets.matmul_gflops(spec["device"], n=2048, dtype="float32", repeats=3)
    rec = Recorder(spec["device"], spec["seed"])
    rec.enter("load")
    if cli.impl == "trl":
        info = run_trl(spec, rec)
    else:
        info = run_ours(spec, rec, plain=cli.impl == "ours_plain")
    result = {
        "impl": cli.impl,
        "size": spec["size"],
        "repeat": spec["repeat"],
        "steps": rec.steps,
        "rss_train_start_mb": rec.rss_train_start,
        "peak_rss_train_start_mb": rec.peak_rss_train_start,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "matmul_probe_gflops": probe,
        "wall_s": time.perf_counter() - started,
        "torch_threads": torch.get_num_threads(),
        **info,
    }
    result["rss_watch"] = rec.watch.stop()
    print(describe(result["rss_watch"]), flush=True)
    if spec["device"] == "cuda":
        result["peak_gpu_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        result["peak_gpu_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    Path(cli.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

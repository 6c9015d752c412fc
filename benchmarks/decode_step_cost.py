"""Milliseconds per HF ``generate`` decode step under each precision set-up a GRPO sampler can run.

    python benchmarks/decode_step_cost.py                      # CPU: host cost at Qwen2.5-0.5B's depth
    python benchmarks/decode_step_cost.py --device cuda --hidden 896 --heads 14 --intermediate 4864 \
        --vocab 151936 --rows 64                               # GPU: the real Qwen2.5-0.5B shape

A decode step of a small model at 64 rows is bound by the host (Python, dispatch, kernel launches),
not by arithmetic: per step it runs every layer's ~15 ops whatever their size. The default shape
keeps Qwen2.5-0.5B's depth (24 layers, 14 heads, 2 KV heads) and shrinks the widths so that the
arithmetic is nearly free, which on CPU isolates that host cost: the part of a GPU decode step that
CUDA graphs (a static cache with the compiled decode step, docs/samplers.md) remove and that
casting fewer tensors shrinks. Modes:

* ``fp32``: no autocast (fp32 weights, fp32 compute);
* ``autocast``: ``bf16`` autocast with its cast cache off, as Lightning's ``bf16-mixed`` opens it and
  as TRL's per-forward autocast behaves: every decode step casts every weight again;
* ``autocast+cast_cache``: the same with ``reused_weight_casts`` around the request, as our
  ``hf_generate`` and ``fast_generate`` run (one cast per weight per request);
* ``autocast+static_compiled`` (only when named in ``--modes``): ``hf_generate``'s set-up with
  ``cache_implementation: static`` and ``disable_compile: false``: transformers' compiled decode step
  (CUDA graphs on a GPU) on a static cache sized as ``hf_generate`` sizes it; the compilation is the
  warm-up call, reported apart. On CPU transformers does not compile by itself, so the benchmark
  asks it to (``CompileConfig._compile_all_devices``): inductor's CPU code, no graphs, so a CPU
  figure says little about a GPU one.

Each mode: a warm-up call, then ``--repeats`` timed calls of ``--new-tokens`` decode steps
(``min_new_tokens`` = ``max_new_tokens``, sampling at temperature 1), the modes taking turns call by
call so that a drifting machine load hits each alike; the median is reported with
the number of casts (``aten::_to_copy``) and matmuls a step runs, counted by the profiler over a call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE))

MODES = ("fp32", "autocast", "autocast+cast_cache", "autocast+static_compiled")
DEFAULT_MODES = MODES[:3]  # the eager ones


def build_model(args: argparse.Namespace):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(args.device).eval()


def generation_config(args: argparse.Namespace, mode: str):
    from transformers import CompileConfig, GenerationConfig

    from grpo_lightning.samplers.hf_generate import static_cache_length

    config = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=1, disable_compile=True)
    if mode != "autocast+static_compiled":
        return config
    config.cache_implementation, config.disable_compile = "static", False
    if not args.device.startswith("cuda"):
        config.compile_config = CompileConfig()
        config.compile_config._compile_all_devices = True  # transformers compiles on its GPU types only
    return static_cache_length(config, args.prompt_tokens, 4096)


def precision(mode: str, device: str):
    import torch

    from grpo_lightning.utils.weight_casts import reused_weight_casts

    if mode == "fp32":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(torch.device(device).type, dtype=torch.bfloat16, cache_enabled=False))
    if mode in ("autocast+cast_cache", "autocast+static_compiled"):
        stack.enter_context(reused_weight_casts(device, True))
    return stack


def timed_call(model, inputs: dict, config, mode: str, device: str) -> float:
    """Seconds per decode step of one ``generate`` call."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad(), precision(mode, device):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(**inputs, generation_config=config)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return (time.perf_counter() - started) / config.max_new_tokens


def ops_per_step(model, inputs: dict, config, mode: str, device: str) -> dict[str, float]:
    """Casts (``aten::_to_copy``) and matmuls of one call, and per forward (a call of N new tokens
    runs N forwards: the prefill and N - 1 decode steps; casts made once per call, such as the
    cached weights', count 1/N)."""
    from torch.profiler import profile

    with profile() as prof:
        timed_call(model, inputs, config, mode, device)
    counts = {e.key: e.count for e in prof.key_averages()}
    casts = counts.get("aten::_to_copy", 0)
    matmuls = counts.get("aten::mm", 0) + counts.get("aten::addmm", 0)
    forwards = config.max_new_tokens
    return {"casts_per_call": casts, "matmuls_per_call": matmuls,
            "casts": round(casts / forwards, 1), "matmuls": round(matmuls / forwards, 1)}


def measure(args: argparse.Namespace) -> list[dict]:
    import torch

    torch.set_num_threads(args.threads)
    model = build_model(args)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.rows, args.prompt_tokens), generator=generator).to(args.device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    configs = {mode: generation_config(args, mode) for mode in args.modes}
    warmup = {mode: timed_call(model, inputs, configs[mode], mode, args.device) * args.new_tokens
              for mode in args.modes}
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    for _ in range(args.repeats):  # round-robin: a drifting machine load hits every mode alike
        for mode in args.modes:
            times[mode].append(timed_call(model, inputs, configs[mode], mode, args.device))
    rows = []
    for mode in args.modes:
        rows.append({"mode": mode, "ms_per_step": 1000 * statistics.median(times[mode]),
                     "ms_per_step_all": [round(1000 * t, 3) for t in times[mode]], "warmup_call_s": warmup[mode],
                     **ops_per_step(model, inputs, configs[mode], mode, args.device)})
        print(f"[decode] {mode}: {rows[-1]['ms_per_step']:.2f} ms/step (all: {rows[-1]['ms_per_step_all']}), "
              f"{rows[-1]['casts']} casts, {rows[-1]['matmuls']} matmuls a step", flush=True)
    return rows


def markdown(args: argparse.Namespace, rows: list[dict], machine: str) -> str:
    autocast_ms = next((r["ms_per_step"] for r in rows if r["mode"] == "autocast"), None)
    lines = [
        f"Command: `python benchmarks/decode_step_cost.py {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine}; Qwen2 from a config: hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} KV), MLP {args.intermediate}, vocabulary {args.vocab}; {args.rows} rows, "
        f"{args.prompt_tokens}-token prompts, {args.new_tokens} decode steps, median of {args.repeats} calls.",
        "",
        "| mode | ms per decode step | vs autocast (TRL) | casts a step | matmuls a step | warm-up call s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{autocast_ms / r['ms_per_step']:.2f}×" if autocast_ms else "–"
        lines.append(f"| {r['mode']} | {r['ms_per_step']:.2f} | {ratio} | {r['casts']} | {r['matmuls']} | "
                     f"{r['warmup_call_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=112)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--modes", type=lambda v: v.split(","), default=list(DEFAULT_MODES),
                        help=f"comma-separated, of {', '.join(MODES)} (default {','.join(DEFAULT_MODES)})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the host cost of one thread)")
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args()
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    import torch

    from compare_trl import machine_info

    info = machine_info(args.device)
    machine = f"{info['cpu']}, {args.threads} torch thread(s)" + (
        f", GPU {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else "")
    machine += f"; torch {info['torch']}, transformers {info['transformers']}"
    rows = measure(args)
    table = markdown(args, rows, machine)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                             "machine": machine, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()

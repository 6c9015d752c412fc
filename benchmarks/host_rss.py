"""Host memory (RSS) of loading the policy: our ``GRPOModule.configure_model`` against the plain
``AutoModelForCausalLM.from_pretrained`` TRL calls, each in a fresh process (issue #15 item 2).

    python benchmarks/host_rss.py                      # Qwen2.5-0.5B shape (2 GB fp32), ~1 min on 2 cores
    python benchmarks/host_rss.py --size qwen-42m      # quick
    python benchmarks/host_rss.py --device cuda        # also: moved to the GPU, then 2 training steps' worth
                                                       # of work is left to compare_trl.py's per-phase peaks

For every way of loading it prints the process's current RSS and its peak (``ru_maxrss``) after
the imports, after the load and (``--device cuda``) after moving to the GPU, as Markdown and JSON
(``--json``). A load whose peak exceeds the plain ``from_pretrained``'s by more than
``--max-extra-mb`` (default 25 % of the fp32 weights, at least 256 MB) fails the run (exit 1): the
regression check.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

# grpo_module_fit: configure_model as Lightning's fit calls it, inside the strategy's
# tensor_init_context (``with torch.device(root_device)``: on one GPU the weights are created there).
LOADERS = ("from_pretrained", "grpo_module", "grpo_module_fit")


def _rss() -> dict:
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return {"rss_mb": round(current, 1), "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def child(loader: str, model_dir: str, device: str) -> dict:
    """One load in this process; the RSS after each stage."""
    import torch  # noqa: F401  (imports are a stage of their own)
    import transformers  # noqa: F401

    import grpo_lightning.module  # noqa: F401

    out = {"loader": loader, "imports": _rss()}
    started = time.perf_counter()
    if loader == "from_pretrained":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        from grpo_lightning.module import GRPOModule

        module = GRPOModule(model_dir, save_final_model=False)
        with torch.device(device if loader == "grpo_module_fit" else "cpu"):
            module.configure_model()
        model = module.policy
    out["load_s"] = round(time.perf_counter() - started, 2)
    out["loaded"] = _rss()
    with torch.no_grad():  # read every weight, as a move to the GPU does (mmap-backed weights become resident)
        sum(float(p.float().sum()) for p in model.parameters())  # on the GPU already for grpo_module_fit
    out["touched"] = _rss()
    out["param_dtype"] = str(next(model.parameters()).dtype)
    out["param_device"] = str(next(model.parameters()).device)
    if device == "cuda":
        model.to("cuda")
        torch.cuda.synchronize()
        out["on_gpu"] = _rss()
    return out


def build_model_dir(size_name: str, root: Path) -> tuple[Path, float]:
    import bench_assets

    size = bench_assets.SIZES[size_name]
    tokenizer, _ = bench_assets.build_tokenizer(size.tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = bench_assets.build_model(size, tokenizer)
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model", weights_mb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="qwen0.5b", help="a size of benchmarks/bench_assets.py (default qwen0.5b)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--max-extra-mb", type=float, default=None,
                        help="allowed peak above from_pretrained's (default: 25%% of the fp32 weights, at least "
                             "256 MB: the tokenizer and the module's imports take ~110 MB whatever the size)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--_child", nargs=3, metavar=("LOADER", "DIR", "DEVICE"), help=argparse.SUPPRESS)
    parser.add_argument("--_build", nargs=2, metavar=("SIZE", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        print(json.dumps(child(*args._child)))
        return 0
    if args._build:
        print(json.dumps(build_model_dir(args._build[0], Path(args._build[1]))[1]))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        # Every stage in its own process: Linux keeps ru_maxrss across fork/exec, so this parent
        # stays small (no torch) and each child's peak is its own.
        built = subprocess.run([sys.executable, __file__, "--_build", args.size, tmp], capture_output=True, text=True)
        if built.returncode != 0:
            print(built.stderr[-3000:], file=sys.stderr)
            return 2
        model_dir, weights_mb = Path(tmp) / "model", float(built.stdout.strip().splitlines()[-1])
        results = []
        for loader in LOADERS:
            proc = subprocess.run(
                [sys.executable, __file__, "--_child", loader, str(model_dir), args.device],
                capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            )
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 2
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    stages = ["imports", "loaded", "touched"] + (["on_gpu"] if args.device == "cuda" else [])
    print(f"\nHost RSS of loading {args.size} ({weights_mb:,.0f} MB of fp32 weights), MB: current / peak\n")
    print("| loader | " + " | ".join(stages) + " | load s |")
    print("|---|" + "---|" * (len(stages) + 1))
    for r in results:
        cells = [f"{r[s]['rss_mb']:,.0f} / {r[s]['peak_mb']:,.0f}" for s in stages]
        print(f"| {r['loader']} | " + " | ".join(cells) + f" | {r['load_s']} |")
    limit = args.max_extra_mb if args.max_extra_mb is not None else max(256.0, 0.25 * weights_mb)
    base = results[0][stages[-1]]["peak_mb"]
    extra = max(r[stages[-1]]["peak_mb"] for r in results[1:]) - base
    verdict = "ok" if extra <= limit else "FAIL"
    print(f"\nlargest grpo_module peak - from_pretrained peak: {extra:,.0f} MB (limit {limit:,.0f}): {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "device": args.device, "weights_mb": weights_mb,
                                         "results": results, "extra_peak_mb": extra, "limit_mb": limit}, indent=1))
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

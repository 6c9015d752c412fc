"""Time and peak memory of the log-prob forward paths: plain vs chunked LM head vs padding-free.

    python benchmarks/forward_paths.py                      # CPU, Qwen2 ~42M, 151,936-token vocabulary
    python benchmarks/forward_paths.py --vocab 32000 --hidden 512 --layers 6
    python benchmarks/forward_paths.py --device cuda --autocast bf16 --hidden 896 --layers 24 \
        --heads 14 --intermediate 4864 --rows 32 --max-completion 256   # Qwen2.5-0.5B architecture

Two workloads, each path measured in its own subprocess (so one path's freed heap does not hide
another's peak), the runs repeated round-robin (``--rounds``) so that a shared machine's load
drifts hit every path alike; the table gives the best and median step over all rounds:

* ``train``: one training micro-step as ``GRPOModule.training_step`` runs it: completion log-probs
  with grad (entropies for logging, no grad), the dapo loss, backward; gradient checkpointing on
  (the module's default); and with a ``train_token_budget`` of a quarter of the micro-batch's
  tokens (four forward+backward parts).
* ``logprob``: the no-grad old/reference pass over a generation batch, in row chunks of the
  micro-batch size (``rollout_logprobs``), and with a token budget.

Peak memory on CPU is the rise of the process's peak RSS (``VmHWM``, reset before the measured
steps) over the RSS just before them; on CUDA the peak of ``torch.cuda.max_memory_allocated``
over the allocation before them. Prompts are left-padded (``--min-prompt``–``--max-prompt``
tokens, default 16–64, each repeated for ``--generations`` consecutive rows, as GRPO samples
them), completions right-padded (8–``--max-completion`` tokens, one row at the maximum).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PATHS = {
    "plain": dict(chunked_lm_head=False, padding_free=False),
    "chunked": dict(chunked_lm_head=True, padding_free=False),
    "packed": dict(chunked_lm_head=False, padding_free=True, share_prompt_prefix=False),
    "chunked+packed": dict(chunked_lm_head=True, padding_free=True, share_prompt_prefix=False),
    "chunked+packed+shared": dict(chunked_lm_head=True, padding_free=True, share_prompt_prefix=True),
}
# The packed paths above run the mask path (sdpa_mask); these the other attention kernels
# (ForwardOptions.attention_kernel, module/attention_kernels.py). Not in the default --paths.
KERNEL_PATHS = {
    "chunked+packed/varlen": dict(chunked_lm_head=True, padding_free=True, share_prompt_prefix=False,
                                  attention_kernel="varlen"),
    "chunked+packed/flex": dict(chunked_lm_head=True, padding_free=True, share_prompt_prefix=False,
                                attention_kernel="flex"),
    "chunked+packed+shared/flex": dict(chunked_lm_head=True, padding_free=True, share_prompt_prefix=True,
                                       attention_kernel="flex"),
}
DEFAULT_PATHS = tuple(PATHS)
for _name in ("packed", "chunked+packed", "chunked+packed+shared"):
    PATHS[_name] = {**PATHS[_name], "attention_kernel": "sdpa_mask"}
PATHS.update(KERNEL_PATHS)


def _chunk_tokens(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _batch(rows: int, max_completion: int, seed: int, vocab: int, device, generations: int = 1,
           prompt_range: tuple[int, int] = (16, 64)):
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(prompt_range[0], prompt_range[1] + 1, (-(-rows // generations),), generator=g)
    prompt_lengths = prompt_lengths.repeat_interleave(generations)[:rows]  # G samples of each prompt
    completion_lengths = torch.randint(8, max_completion + 1, (rows,), generator=g)
    completion_lengths[0] = max_completion
    tp, t = int(prompt_lengths.max()), int(completion_lengths.max())
    prompt_ids = torch.randint(3, vocab, (-(-rows // generations), tp), generator=g)
    prompt_ids = prompt_ids.repeat_interleave(generations, dim=0)[:rows]
    completion_ids = torch.randint(3, vocab, (rows, t), generator=g)
    cols_p, cols_c = torch.arange(tp), torch.arange(t)
    prompt_mask = (cols_p.unsqueeze(0) >= tp - prompt_lengths.unsqueeze(1)).long()
    completion_mask = (cols_c.unsqueeze(0) < completion_lengths.unsqueeze(1)).long()
    prompt_ids = prompt_ids * prompt_mask
    completion_ids = completion_ids * completion_mask
    advantages = torch.randn(rows, generator=g)
    return [x.to(device) for x in (prompt_ids, prompt_mask, completion_ids, completion_mask, advantages)]


def child(args: argparse.Namespace) -> dict:
    import torch

    from grpo_lightning.algo.shared_prefix import budget_groups
    from grpo_lightning.losses import LossInputs, MicroBatchTotals, get_loss
    from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
    from grpo_lightning.utils.checkpointing import set_activation_checkpointing
    from grpo_lightning.utils.tiny_models import build_tiny_causal_lm

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with device:  # initialise on the device (fast on CUDA)
        model = build_tiny_causal_lm(
            args.vocab, architecture="qwen2", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
            num_kv_heads=2, intermediate_size=args.intermediate or 4 * args.hidden, tie_word_embeddings=True,
            max_position_embeddings=1024,
        )
    model.config._attn_implementation = args.attn
    model.config.use_cache = False
    if args.mode == "train":
        model.train()
        set_activation_checkpointing(model, True)
    else:
        model.eval()
    params = sum(p.numel() for p in model.parameters())
    options = ForwardOptions(**PATHS[args.path], lm_head_chunk_tokens=args.chunk_tokens,
                             logprob_token_budget=args.token_budget, train_token_budget=args.train_token_budget)
    loss_fn = get_loss("dapo")
    rows = args.rows if args.mode == "train" else args.rows * args.generation_chunks
    prompt_range = (args.min_prompt, args.max_prompt)
    batches = [_batch(rows, args.max_completion, 1000 + i, args.vocab, device, args.generations, prompt_range)
               for i in range(args.steps + 1)]

    autocast = args.autocast != "none"
    autocast_dtype = torch.bfloat16 if args.autocast == "bf16" else torch.float16

    def step(batch):
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast):
            return _step(batch)

    def _step(batch):
        prompt_ids, prompt_mask, completion_ids, completion_mask, advantages = batch
        if args.mode == "train":  # as GRPOModule.training_step: one part, or token-budget parts
            groups = [torch.arange(rows, device=device)]
            if options.train_token_budget is not None:
                groups = budget_groups(prompt_ids, prompt_mask, completion_mask, options.train_token_budget,
                                       packed=options.padding_free, share_prompts=options.share_prompt_prefix)
            totals = MicroBatchTotals.of(completion_mask) if len(groups) > 1 else None
            total = 0.0
            for group in groups:
                logps, entropies = completion_logprobs(
                    model, prompt_ids[group], prompt_mask[group], completion_ids[group], completion_mask[group],
                    args.temperature, options=options,
                )
                out = loss_fn(LossInputs(logps=logps, old_logps=None, advantages=advantages[group],
                                         mask=completion_mask[group], entropies=entropies,
                                         num_items_in_batch=completion_mask.sum().float(), totals=totals))
                out.loss.backward()
                total += float(out.loss)
            return total
        with torch.no_grad():  # as GRPOModule.rollout_logprobs: row chunks of the micro-batch size
            for start in range(0, rows, args.rows):
                sl = slice(start, start + args.rows)
                completion_logprobs(model, prompt_ids[sl], prompt_mask[sl], completion_ids[sl],
                                    completion_mask[sl], args.temperature, with_entropy=False, options=options)
        return 0.0

    if device.type == "cuda":
        sync = torch.cuda.synchronize
    else:
        def sync():
            return None

    step(batches[0])  # warm-up (allocates gradients)
    model.zero_grad(set_to_none=False)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
        _reset_peak_rss()
    times = []
    for batch in batches[1:]:
        started = time.perf_counter()
        step(batch)
        sync()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=False)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss_bytes()
    tokens = sum(int(b[1].sum() + b[3].sum()) for b in batches[1:])
    from grpo_lightning.module import lm_head_calibration

    chosen = lm_head_calibration.measured_chunk_tokens()  # what `auto` measured and picked (CUDA)
    return dict(path=args.path, mode=args.mode, params=params, times=times, tokens=tokens,
                peak_mib=(peak - base) / 2**20, auto_chunk_tokens=chosen)


def summarize(collected: dict[tuple[str, str], list[dict]]) -> list[dict]:
    """One row per (mode, path) over its rounds: best and median step, tokens/s, peak memory."""
    results = []
    for (mode, name), parts in collected.items():
        times = [t for part in parts for t in part["times"]]
        tokens = sum(part["tokens"] for part in parts)
        results.append(dict(mode=mode, path=name, params=parts[0]["params"], best_s=min(times),
                            median_s=statistics.median(times), tokens_per_s=tokens / sum(times),
                            peak_mib=max(part["peak_mib"] for part in parts),
                            auto_chunk_tokens=parts[0].get("auto_chunk_tokens", [])))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 x hidden)")
    parser.add_argument("--attn", default="sdpa", help="attention implementation")
    parser.add_argument("--autocast", choices=["none", "bf16", "fp16"], default="none")
    parser.add_argument("--rows", type=int, default=16, help="micro-batch rows (8 generations x 2 prompts)")
    parser.add_argument("--generation-chunks", type=int, default=2, help="micro-batches per generation batch (logprob)")
    parser.add_argument("--max-completion", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--chunk-tokens", type=_chunk_tokens, default=1024, help="LM-head chunk tokens or 'auto'")
    parser.add_argument("--token-budget", type=int, default=None, help="logprob_token_budget of every path")
    parser.add_argument("--train-token-budget", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--generations", type=int, default=8, help="rows per prompt (GRPO's num_generations)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="round-robin repetitions of every run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"comma-separated, from: {', '.join(PATHS)}")
    parser.add_argument("--modes", default="train,logprob")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="train", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    passthrough, skip = [], False
    for arg in sys.argv[1:]:  # everything but --json (and its value) goes to the children
        if skip or arg.startswith("--json"):
            skip = arg == "--json"
            continue
        passthrough.append(arg)
    runs = [(m, p) for m in args.modes.split(",") for p in args.paths.split(",")]
    if "logprob" in args.modes.split(",") and args.token_budget is None:
        budget = args.rows * (args.max_prompt + args.max_completion) // 2
        runs.append(("logprob", f"chunked+packed+shared@budget={budget}"))
    if "train" in args.modes.split(","):  # a quarter of the micro-batch's tokens per part
        budget = args.rows * ((args.min_prompt + args.max_prompt) // 2 + args.max_completion // 2) // 4
        runs.append(("train", f"chunked+packed+shared@train_budget={budget}"))
    collected: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):  # round-robin, so that load drifts hit every path alike
        for mode, name in runs:
            path, extra = name, []
            if "@budget=" in name:
                path, budget = name.split("@budget=")
                extra = ["--token-budget", budget]
            elif "@train_budget=" in name:
                path, budget = name.split("@train_budget=")
                extra = ["--train-token-budget", budget]
            cmd = [sys.executable, __file__, *passthrough, "--child", "--path", path, "--mode", mode, *extra]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{mode}/{name} failed")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            collected.setdefault((mode, name), []).append(result)
            chosen = f"  auto chunk {result['auto_chunk_tokens']}" if result.get("auto_chunk_tokens") else ""
            print(f"round {round_index + 1} {mode:8s} {name:32s} median {statistics.median(result['times']):8.3f} s  "
                  f"peak +{result['peak_mib']:8.1f} MiB{chosen}", flush=True)
            if args.json:  # after every run: a run cut off by a time limit keeps what it measured
                Path(args.json).write_text(json.dumps(dict(args=vars(args), results=summarize(collected)), indent=2))
    results = summarize(collected)

    params = results[0]["params"] if results else 0
    print(f"\nQwen2 {params / 1e6:.1f}M parameters (vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
          f"tied), {args.rows} rows/micro-batch, completions 8-{args.max_completion}, device {args.device}, "
          f"{args.threads} threads, attention {args.attn}, autocast {args.autocast}, "
          f"LM-head chunk {args.chunk_tokens} tokens\n")
    print("| workload | path | best step (s) | median step (s) | tokens/s | peak memory rise (MiB) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['mode']} | {r['path']} | {r['best_s']:.3f} | {r['median_s']:.3f} | {r['tokens_per_s']:.0f} "
              f"| {r['peak_mib']:.1f} |")


if __name__ == "__main__":
    main()

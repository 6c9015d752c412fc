"""Summaries of the benchmark runs and the Markdown report."""

from __future__ import annotations

import statistics

from bench_child import PHASES

LABELS = {"ours": "ours", "ours_plain": "ours, plain forward", "trl": "TRL"}
SPLIT = ("generation", "reward", "logprob", "fwd+bwd", "optimizer", "other")


# A CPU step whose process got less than this share of its threads' time (CPU-s per wall-s /
# threads) ran while other processes held the cores: it is left out of the figures when at least
# one step of the run was not contended (both trainers alike; the count is reported).
CONTENDED_BELOW = 0.7


def is_clean(step: dict, run: dict, device: str) -> bool:
    return device != "cpu" or step.get("cpu_util", 99) >= CONTENDED_BELOW * run["torch_threads"]


def train_flops(step: dict, params: dict) -> float:
    """FLOPs a GRPO training pass needs: 6 x (decoder parameters x all tokens + LM-head parameters
    x completion tokens). The LM head is only needed where a completion token is predicted; the
    plain 6·N·T (every position through the head) is kept as ``train_mfu_6nt``."""
    return 6 * (params["body"] * (step["prompt_tokens"] + step["completion_tokens"])
                + params["head"] * step["completion_tokens"])


def summarize_run(run: dict, warmup: int, params: dict, peak_gflops: float, device: str = "cpu") -> dict:
    """Per-run figures over the measured steps (the first ``warmup`` steps are dropped).

    The machine is shared, so a step can be slowed by other work: headline figures are medians
    over steps (tokens/s is the median of per-step tokens/s; the plain total-tokens/total-time
    figure is kept as ``tokens_per_s_total``). The split is the per-phase median over steps.
    """
    measured = run["steps"][warmup:]
    steps = measured
    if device == "cpu":
        clean = [s for s in measured if is_clean(s, run, device)]
        steps = clean or measured
    med = statistics.median
    total = sum(s["step_time"] for s in steps)
    prompt = sum(s["prompt_tokens"] for s in steps)
    completion = sum(s["completion_tokens"] for s in steps)
    rows = sum(s["rows"] for s in steps)
    tokens = prompt + completion
    split = {p: med(s[p] for s in steps) for p in (*PHASES, "other")}
    split["fwd+bwd"] = med(s["forward"] + s["backward"] for s in steps)
    step_tokens = [s["prompt_tokens"] + s["completion_tokens"] for s in steps]
    return {
        "measured_steps": len(measured),
        "contended_steps_dropped": len(measured) - len(steps),
        "all_steps_contended": device == "cpu" and len(steps) == len(measured) and any(
            s.get("cpu_util", 99) < CONTENDED_BELOW * run["torch_threads"] for s in measured),
        "median_step_s": med(s["step_time"] for s in steps),
        "tokens_per_s": med(t / s["step_time"] for t, s in zip(step_tokens, steps)),
        "tokens_per_s_total": tokens / total,
        "tokens_per_step": tokens / len(steps),
        "mean_prompt_len": prompt / rows,
        "mean_completion_len": completion / rows,
        "max_completion_len": max(s["max_completion"] for s in steps),
        "truncated_frac": sum(s["truncated"] for s in steps) / rows,
        "split_s": {k: split[k] for k in SPLIT},
        "split_detail_s": {k: split[k] for k in ("forward", "backward")},
        "generation_tokens_per_s": med(s["completion_tokens"] / s["generation"] for s in steps if s["generation"]),
        "train_tokens_per_s": med(t / (s["forward"] + s["backward"]) for t, s in zip(step_tokens, steps)),
        # Model FLOPs utilisation of the training phase: the FLOPs the pass needs over the
        # forward+backward time, as a fraction of the dense matmul peak.
        "train_mfu": med(train_flops(s, params) / (s["forward"] + s["backward"]) for s in steps) / (peak_gflops * 1e9),
        "train_mfu_6nt": med(6 * params["matmul"] * t / (s["forward"] + s["backward"]) for t, s in zip(step_tokens, steps))
        / (peak_gflops * 1e9),
        "cpu_util": med(s.get("cpu_util", float("nan")) for s in steps),
        "peak_rss_mb": run["peak_rss_mb"],
        "rss_train_start_mb": run["rss_train_start_mb"],
        "peak_gpu_allocated_mb": run.get("peak_gpu_allocated_mb"),
        "matmul_probe_gflops": run["matmul_probe_gflops"],
        # Inside model.generate (both sides time the call itself) and the garbage collector, when recorded.
        **({"hf_generate_s": med(s["hf_generate_s"] for s in steps),
            "ms_per_decode_step": med(1000 * s["hf_generate_s"] / s["decode_steps"] for s in steps),
            "gc_s": med(s.get("gc_s", 0.0) for s in steps)}
           if all(s.get("decode_steps") for s in steps) else {}),
        "logged_loss": [s.get("logged_loss") for s in run["steps"]],
        "logged_reward": [s.get("logged_reward") for s in run["steps"]],
    }


def combine(summaries: list[dict]) -> dict:
    """Median over repetitions (and the range of the headline numbers)."""
    med = lambda key: statistics.median(s[key] for s in summaries)  # noqa: E731
    out = {k: med(k) for k in ("median_step_s", "tokens_per_s", "tokens_per_step", "mean_prompt_len",
                               "mean_completion_len", "truncated_frac", "generation_tokens_per_s",
                               "train_tokens_per_s", "train_mfu", "peak_rss_mb", "rss_train_start_mb",
                               "cpu_util", "tokens_per_s_total")}
    out["contended_steps_dropped"] = sum(s["contended_steps_dropped"] for s in summaries)
    out["runs_all_steps_contended"] = sum(bool(s["all_steps_contended"]) for s in summaries)
    out["split_s"] = {k: statistics.median(s["split_s"][k] for s in summaries) for k in SPLIT}
    out["step_s_range"] = [min(s["median_step_s"] for s in summaries), max(s["median_step_s"] for s in summaries)]
    out["tokens_per_s_range"] = [min(s["tokens_per_s"] for s in summaries), max(s["tokens_per_s"] for s in summaries)]
    gpu = [s["peak_gpu_allocated_mb"] for s in summaries if s.get("peak_gpu_allocated_mb") is not None]
    out["peak_gpu_allocated_mb"] = statistics.median(gpu) if gpu else None
    out["repeats"] = len(summaries)
    return out


def ratios(ours: list[dict], trl: list[dict], ours_runs: list[dict], trl_runs: list[dict], warmup: int,
           device: str) -> dict:
    """ours/TRL. Headline ``tokens_per_s``: paired by step. Every run draws the same prompts and
    (re-seeded) the same completions at step k, so step k is the same work on both sides: for each
    measured step k, the median over runs of each trainer's tokens/s at step k (contended CPU steps
    left out), ratio ours/TRL; then the median over k. Also: the ratio of the per-trainer medians."""
    def of(key):
        a, b = statistics.median(s[key] for s in ours), statistics.median(s[key] for s in trl)
        return a / b if b else float("nan")

    def at(runs, k):
        rates = [r["steps"][k]["prompt_tokens"] + r["steps"][k]["completion_tokens"] for r in runs]
        rates = [t / r["steps"][k]["step_time"] for t, r in zip(rates, runs) if is_clean(r["steps"][k], r, device)]
        return statistics.median(rates) if rates else None

    steps = min(len(r["steps"]) for r in ours_runs + trl_runs)
    per_step = []
    for k in range(warmup, steps):
        a, b = at(ours_runs, k), at(trl_runs, k)
        if a is not None and b is not None:
            per_step.append(a / b)
    pairs = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(ours, trl)]  # repeat r with repeat r
    completions = [[statistics.median(r["steps"][k]["completion_tokens"] for r in side) for side in (ours_runs, trl_runs)]
                   for k in range(steps)]
    return {
        # [ours, TRL] completion tokens at each step (median over runs, warm-up included). With
        # hf_generate on both sides they are equal while the two sides do the same work; a measured
        # step where they differ makes its tokens/s ratio one over different work.
        "completion_tokens_by_step": completions,
        "unpaired_steps": [k for k in range(warmup, steps) if completions[k][0] != completions[k][1]],
        "phase_s": {phase: [statistics.median(s["split_s"][phase] for s in side) for side in (ours, trl)]
                    for phase in SPLIT},
        "tokens_per_s": statistics.median(per_step) if per_step else of("tokens_per_s"),
        "tokens_per_s_by_step": per_step,
        "tokens_per_s_of_medians": of("tokens_per_s"),
        "median_step_s": of("median_step_s"),
        "peak_rss_mb": of("peak_rss_mb"),
        "tokens_per_s_pairs": pairs,
        **({"peak_gpu_allocated_mb": of("peak_gpu_allocated_mb")}
           if all(s.get("peak_gpu_allocated_mb") for s in ours + trl) else {}),
    }


def generate_call_lines(summaries: dict[str, list[dict]]) -> list[str]:
    """Per trainer: the median seconds inside ``model.generate`` against the generation phase,
    the milliseconds per decode step, and the garbage collector's seconds per step."""
    lines = []
    for impl, runs in summaries.items():
        run = runs[0] if runs else {}
        if "hf_generate_s" not in run:
            continue
        lines.append(f"Generation, {LABELS.get(impl, impl)} repeat 0: {run['hf_generate_s']:.3f} s inside `model.generate` "
                     f"of {run['split_s']['generation']:.3f} s in the phase, {run['ms_per_decode_step']:.1f} ms per decode "
                     f"step; garbage collection {run['gc_s']:.3f} s per step.  ")
    return lines


#: Paths of the code a reader can act on: a peak inside torch.nn is reported with its caller here.
OWN_CODE = ("grpo_lightning/", "/trl/", "/transformers/", "/lightning/", "benchmarks/")


def telling_frames(stack: list[str], count: int) -> list[str]:
    """The innermost frame and the innermost ``count - 1`` frames of :data:`OWN_CODE`, outer first.

    >>> telling_frames(["/b/bench_child.py:9 main: x", "/p/grpo_lightning/f.py:5 f: y", "/t/torch/nn/linear.py:1 forward: z"], 2)
    ['/p/grpo_lightning/f.py:5 f: y', '/t/torch/nn/linear.py:1 forward: z']
    """
    if not stack:
        return []
    own = [f for f in stack[:-1] if any(k in f.split(" ", 1)[0] for k in OWN_CODE)]
    return own[-(count - 1):] + stack[-1:] if count > 1 else stack[-1:]


def host_peak_lines(runs: dict[str, list[dict]], frames: int = 3) -> list[str]:
    """Where each run's host memory peaked (``rss_watch`` of bench_child.py): its split, its phase
    and the innermost frames of the main thread, one line per run; none for runs without it."""
    lines = []
    for impl, impl_runs in runs.items():
        for run in impl_runs:
            peak = (run.get("rss_watch") or {}).get("peak")
            if not peak:
                continue
            split = ", ".join(f"{k[:-3]} {peak[k]:,.0f}" for k in ("anon_mb", "file_mb", "shmem_mb", "pinned_host_mb")
                              if k in peak)
            where = " ← ".join(f"`{f.split(' ', 1)[0].rsplit('/', 1)[-1]} {f.split(' ', 2)[1].rstrip(':')}`"
                               for f in reversed(telling_frames(peak.get("stack", []), frames)))
            lines.append(f"Host peak, {LABELS.get(impl, impl)} repeat {run.get('repeat', 0)}: {peak['rss_mb']:,.0f} MB "
                         f"({split}) in {peak['phase']}" + (f", at {where}" if where else "") + ".  ")
    return ([""] + lines) if lines else []


def _f(x, digits=2):
    if x is None:
        return "–"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# grpo_lightning vs TRL GRPOTrainer — {report['device'].upper()} benchmark",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['memory_gb']} GB RAM"
        + (f", GPU {m['gpu']}" if m.get("gpu") else "") + "  ",
        f"Software: torch {m['torch']}, lightning {m['lightning']}, transformers {m['transformers']}, trl {m['trl']}, "
        f"python {m['python']}  ",
        f"Date: {m['date']}; load average at start {m['loadavg_start']}, at end {m.get('loadavg_end', '?')}  ",
        f"Dense {report['peak_dtype']} matmul ({report['peak_n']}²): {_f(report['peak_gflops'], 0)} GFLOP/s "
        f"(best of the probes at start/end: {', '.join(_f(x, 0) for x in report['peak_probes'])}); "
        "each run's own probe is in the JSON.",
        *(["", f"**Note:** {report['note']}"] if report.get("note") else []),
        "",
        "Figures are medians over the repetitions (alternating ours/TRL, one process per run); a step is one "
        "optimizer step (generation + scoring + training), the first steps of each run are warm-up and excluded. "
        "tokens/s = (prompt + completion tokens of a step) / step wall time, median over the measured steps "
        "(the total-tokens/total-time figure is in the JSON). Split = median seconds per step in each phase. "
        "Train MFU = FLOPs needed / (forward+backward time × the matmul peak above), FLOPs needed = "
        "6 × (decoder parameters × all tokens + LM-head parameters × completion tokens) (the plain 6·N·T "
        "is in the JSON). gen tok/s = completion tokens / generation time. ours/TRL tokens/s is paired by "
        "step: both trainers see the same prompts at each step, and, when our sampler is hf_generate, the same "
        "sampled completions; another sampler draws other completions of the same distribution (compare the "
        "completion lengths).",
        "",
    ]
    for name, size in report["sizes"].items():
        s = size["settings"]
        same_sampler = s.get("sampler", "hf_generate") == "hf_generate"  # ours samples as TRL's generate does
        lines += [
            f"## {name}: {size['assets']['num_parameters'] / 1e6:.2f}M parameters",
            "",
            f"{size['description']}; {size['assets']['tokenizer']}.  ",
            f"{s['prompts_per_step']} prompts × {s['num_generations']} completions per step (per-device batch "
            f"{s['per_device_train_batch_size']}, no accumulation), completions ≤ {s['max_completion_length']} tokens "
            f"(EOS allowed, biased to a mean of ~{size['assets']['eos_bias']['target_mean_length']:.0f}), "
            f"{s['precision']}, gradient checkpointing {'on' if s['gradient_checkpointing'] else 'off'}, "
            f"loss {s['loss_type']}, beta {s['beta']}, lr {s['learning_rate']}, seed {s['seed']}; "
            f"{s['warmup_steps']} warm-up + {s['measured_steps']} measured steps × {size['repeats']} repeats.  ",
            f"Our generation back-end: `{s.get('sampler', 'hf_generate')}`"
            + (f", importance-sampling correction {s.get('importance_sampling', 'default')}"
               if not same_sampler else "")
            + (f", generation_kwargs {s['generation_kwargs']}" if s.get("generation_kwargs") else "")
            + ("; TRL: transformers `generate`." if s.get("trl_generation", "generate") == "generate" else
               "; TRL: transformers continuous batching (`use_transformers_continuous_batching`, which casts "
               "TRL's model to bf16 in place: its training then runs on bf16 weights).")
            + ("" if same_sampler and s.get("trl_generation", "generate") == "generate" else
               " The two draw their random numbers differently: the completions differ between the trainers "
               "(same distribution), so each trainer's completion lengths are shown."),
            "",
        ]
        if size.get("errors"):
            lines += [f"**Failed runs:** {'; '.join(size['errors'])}", ""]
        if "ours" not in size["combined"] or "trl" not in size["combined"]:
            continue
        lines += [
            "| | step s (range) | tokens/s | gen | reward | logprob | fwd+bwd | optim | other | peak RSS MB "
            "(at start) | gen tok/s | train MFU | completion len (trunc.) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        impls = [i for i in ("ours", "ours_plain", "trl") if i in size["combined"]]
        for impl in impls:
            c = size["combined"][impl]
            sp = c["split_s"]
            rss = f"{_f(c['peak_rss_mb'], 0)} ({_f(c['rss_train_start_mb'], 0)})"
            if c.get("peak_gpu_allocated_mb"):
                rss += f"; GPU {_f(c['peak_gpu_allocated_mb'], 0)}"
            lines.append(
                f"| {LABELS[impl]} | {_f(c['median_step_s'], 3)} "
                f"({_f(c['step_s_range'][0], 3)}–{_f(c['step_s_range'][1], 3)}) | {_f(c['tokens_per_s'], 0)} | "
                + " | ".join(_f(sp[k], 3) for k in SPLIT)
                + f" | {rss} | {_f(c['generation_tokens_per_s'], 0)} | {100 * c['train_mfu']:.1f}% | "
                f"{_f(c['mean_completion_len'], 1)} ({100 * c['truncated_frac']:.0f}%) |"
            )
        r = size["ratios"]
        gpu = f"; GPU memory {r['peak_gpu_allocated_mb']:.2f}" if "peak_gpu_allocated_mb" in r else ""
        lines.append(f"| **ours/TRL** | **{r['median_step_s']:.2f}** | **{r['tokens_per_s']:.2f}** | | | | | | | "
                     f"**{r['peak_rss_mb']:.2f}**{gpu} | | | |")
        if size.get("ratios_plain"):
            rp = size["ratios_plain"]
            gpu = f"; GPU memory {rp['peak_gpu_allocated_mb']:.2f}" if "peak_gpu_allocated_mb" in rp else ""
            lines.append(f"| ours (plain forward)/TRL | {rp['median_step_s']:.2f} | {rp['tokens_per_s']:.2f} | | | | | | | "
                         f"{rp['peak_rss_mb']:.2f}{gpu} | | | |")
        lines += host_peak_lines(size["runs"])
        lines += generate_call_lines(size.get("summaries", {}))
        if same_sampler and r.get("unpaired_steps"):
            by_step = ", ".join(f"{k}: {a:g} vs {b:g}" for k, (a, b) in enumerate(r["completion_tokens_by_step"]))
            lines += ["", f"**Not paired**: the completions differ at measured step(s) "
                          f"{', '.join(map(str, r['unpaired_steps']))} (completion tokens by step, ours vs TRL: {by_step}), "
                          "so the ratios above compare different work (usually the two runs' updates moved their weights apart); "
                          "rerun with `--learning-rate 1e-12` (the optimizer's full work, weights unchanged) for a "
                          "paired measurement."]
        lines += [
            "",
            f"ours/TRL tokens/s step by step (the same prompts"
            f"{' and completions' if same_sampler and not r.get('unpaired_steps') else ''} on both sides; median = the "
            f"ratio above): {', '.join(f'{x:.2f}' for x in r['tokens_per_s_by_step'])}; ratio of the medians "
            f"{r['tokens_per_s_of_medians']:.2f}; repeat by repeat: "
            f"{', '.join(f'{x:.2f}' for x in r['tokens_per_s_pairs'])}. Total tokens / total time: ours "
            f"{_f(size['combined']['ours']['tokens_per_s_total'], 0)}, TRL {_f(size['combined']['trl']['tokens_per_s_total'], 0)}."
            + ("" if report["device"] != "cpu" else
               f" Process CPU-s per wall-s (median step; {report['machine']['torch_threads']} = all threads busy, "
               f"lower = the cores were shared): ours {size['combined']['ours']['cpu_util']:.2f}, "
               f"TRL {size['combined']['trl']['cpu_util']:.2f}. Contended steps left out (CPU-s/wall-s below "
               f"{CONTENDED_BELOW:.0%} of the threads): ours {size['combined']['ours']['contended_steps_dropped']}, "
               f"TRL {size['combined']['trl']['contended_steps_dropped']}; runs left out because every step was "
               f"contended: ours {size['combined']['ours'].get('runs_left_out', 0)}, "
               f"TRL {size['combined']['trl'].get('runs_left_out', 0)}."),
            "",
        ]
    if report.get("targets"):
        lines += ["## Targets", "", "| issue | size | target | measured | met |", "|---|---|---|---|---|"]
        for t in report["targets"]:
            lines.append(f"| {t.get('issue', '4')} | {t['size']} | {t['target']} | {t['measured']} | "
                         f"{'yes' if t['met'] else '**no**'} |")
        lines.append("")
    return "\n".join(lines)

"""Summaries of the benchmark runs and the Markdown report."""

from __future__ import annotations

import statistics

from bench_child import PHASES

SPLIT = ("generation", "reward", "logprob", "fwd+bwd", "optimizer", "other")


def summarize_run(run: dict, warmup: int, matmul_params: int, peak_gflops: float) -> dict:
    """Per-run figures over the measured steps (the first ``warmup`` steps are dropped).

    The machine is shared, so a step can be slowed by other work: headline figures are medians
    over steps (tokens/s is the median of per-step tokens/s; the plain total-tokens/total-time
    figure is kept as ``tokens_per_s_total``). The split is the per-phase median over steps.
    """
    steps = run["steps"][warmup:]
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
        "measured_steps": len(steps),
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
        # Model FLOPs utilisation of the training phase: 6 * N * tokens over the forward+backward time.
        "train_mfu": med(6 * matmul_params * t / (s["forward"] + s["backward"]) for t, s in zip(step_tokens, steps))
        / (peak_gflops * 1e9),
        "peak_rss_mb": run["peak_rss_mb"],
        "rss_train_start_mb": run["rss_train_start_mb"],
        "peak_gpu_allocated_mb": run.get("peak_gpu_allocated_mb"),
        "matmul_probe_gflops": run["matmul_probe_gflops"],
        "logged_loss": [s.get("logged_loss") for s in run["steps"]],
        "logged_reward": [s.get("logged_reward") for s in run["steps"]],
    }


def combine(summaries: list[dict]) -> dict:
    """Median over repetitions (and the range of the headline numbers)."""
    med = lambda key: statistics.median(s[key] for s in summaries)  # noqa: E731
    out = {k: med(k) for k in ("median_step_s", "tokens_per_s", "tokens_per_step", "mean_prompt_len",
                               "mean_completion_len", "truncated_frac", "generation_tokens_per_s",
                               "train_tokens_per_s", "train_mfu", "peak_rss_mb", "rss_train_start_mb")}
    out["split_s"] = {k: statistics.median(s["split_s"][k] for s in summaries) for k in SPLIT}
    out["step_s_range"] = [min(s["median_step_s"] for s in summaries), max(s["median_step_s"] for s in summaries)]
    out["tokens_per_s_range"] = [min(s["tokens_per_s"] for s in summaries), max(s["tokens_per_s"] for s in summaries)]
    gpu = [s["peak_gpu_allocated_mb"] for s in summaries if s.get("peak_gpu_allocated_mb") is not None]
    out["peak_gpu_allocated_mb"] = statistics.median(gpu) if gpu else None
    out["repeats"] = len(summaries)
    return out


def ratios(ours: list[dict], trl: list[dict]) -> dict:
    """ours/TRL: of the medians, and per alternating pair (repeat r of each)."""
    def of(key):
        a, b = statistics.median(s[key] for s in ours), statistics.median(s[key] for s in trl)
        return a / b if b else float("nan")

    pairs = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(ours, trl)]
    return {
        "tokens_per_s": of("tokens_per_s"),
        "median_step_s": of("median_step_s"),
        "peak_rss_mb": of("peak_rss_mb"),
        "tokens_per_s_pairs": pairs,
        **({"peak_gpu_allocated_mb": of("peak_gpu_allocated_mb")}
           if all(s.get("peak_gpu_allocated_mb") for s in ours + trl) else {}),
    }


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
        "",
        "Figures are medians over the repetitions (alternating ours/TRL, one process per run); a step is one "
        "optimizer step (generation + scoring + training), the first steps of each run are warm-up and excluded. "
        "tokens/s = (prompt + completion tokens of a step) / step wall time, median over the measured steps "
        "(the total-tokens/total-time figure is in the JSON). Split = median seconds per step in each phase. "
        "Train MFU = 6·N·tokens / (forward+backward time × the matmul peak above), N = parameters used in "
        "matmuls. gen tok/s = completion tokens / generation time.",
        "",
    ]
    for name, size in report["sizes"].items():
        s = size["settings"]
        lines += [
            f"## {name}: {size['assets']['num_parameters'] / 1e6:.2f}M parameters",
            "",
            f"{size['description']}; {size['assets']['tokenizer']}.  ",
            f"{s['prompts_per_step']} prompts × {s['num_generations']} completions per step (per-device batch "
            f"{s['per_device_train_batch_size']}, no accumulation), completions ≤ {s['max_completion_length']} tokens "
            f"(EOS allowed, biased to a mean of ~{size['assets']['eos_bias']['target_mean_length']:.0f}), "
            f"{s['precision']}, gradient checkpointing {'on' if s['gradient_checkpointing'] else 'off'}, "
            f"loss {s['loss_type']}, beta {s['beta']}, lr {s['learning_rate']}, seed {s['seed']}; "
            f"{s['warmup_steps']} warm-up + {s['measured_steps']} measured steps × {size['repeats']} repeats.",
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
        for impl in ("ours", "trl"):
            c = size["combined"][impl]
            sp = c["split_s"]
            rss = f"{_f(c['peak_rss_mb'], 0)} ({_f(c['rss_train_start_mb'], 0)})"
            if c.get("peak_gpu_allocated_mb"):
                rss += f"; GPU {_f(c['peak_gpu_allocated_mb'], 0)}"
            lines.append(
                f"| {'ours' if impl == 'ours' else 'TRL'} | {_f(c['median_step_s'], 3)} "
                f"({_f(c['step_s_range'][0], 3)}–{_f(c['step_s_range'][1], 3)}) | {_f(c['tokens_per_s'], 0)} | "
                + " | ".join(_f(sp[k], 3) for k in SPLIT)
                + f" | {rss} | {_f(c['generation_tokens_per_s'], 0)} | {100 * c['train_mfu']:.1f}% | "
                f"{_f(c['mean_completion_len'], 1)} ({100 * c['truncated_frac']:.0f}%) |"
            )
        r = size["ratios"]
        gpu = f"; GPU memory {r['peak_gpu_allocated_mb']:.2f}" if "peak_gpu_allocated_mb" in r else ""
        lines += [
            f"| **ours/TRL** | **{r['median_step_s']:.2f}** | **{r['tokens_per_s']:.2f}** | | | | | | | "
            f"**{r['peak_rss_mb']:.2f}**{gpu} | | | |",
            "",
            f"Per-pair tokens/s ratios (ours/TRL, repeat by repeat): "
            f"{', '.join(f'{x:.2f}' for x in r['tokens_per_s_pairs'])}.",
            "",
        ]
    if report.get("targets"):
        lines += ["## Targets (issue 4)", "", "| size | target | measured | met |", "|---|---|---|---|"]
        for t in report["targets"]:
            lines.append(f"| {t['size']} | {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |")
        lines.append("")
    return "\n".join(lines)

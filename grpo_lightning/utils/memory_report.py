"""The memory plan as a table, the device's memory, and which setting to change when it does not fit.

The advice is computed, not guessed: each remedy (a setting a user can change) is applied to the
settings, the plan re-estimated, and the remedies named in order of the peak they leave, those
that fit first, each with the value that fits where a value is needed.

Layer L0: pure python + torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from grpo_lightning.utils.memory_plan import GiB, MemoryPlan, MemorySettings, estimate_memory


@dataclass(frozen=True)
class Remedy:
    """A setting to change and the peak the run would have with it."""

    setting: str
    total: int

    def fits(self, budget: int) -> bool:
        return self.total <= budget


def device_memory_bytes(device: torch.device | str) -> tuple[int | None, str]:
    """``(bytes, description)`` of the memory a run on ``device`` can use.

    CUDA: the device's total memory. CPU: the RAM still available (``MemAvailable``) plus what
    this process already holds (it is part of what the run can reach), else total RAM.
    """
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device.index or 0)
        return int(props.total_memory), f"{props.name} ({device})"
    available = _meminfo("MemAvailable")
    if available is not None:
        return available + current_rss_bytes(), "CPU RAM available to this process"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "CPU RAM"
    except (ValueError, OSError, AttributeError):
        return None, "CPU RAM (unknown)"


def _meminfo(key: str, path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    """This process's resident set (``VmRSS``), 0 where ``/proc`` is not available."""
    return _meminfo("VmRSS", "/proc/self/status") or 0


def peak_rss_bytes() -> int:
    """This process's peak resident set since start or the last :func:`reset_peak_rss` (``VmHWM``)."""
    return _meminfo("VmHWM", "/proc/self/status") or 0


def current_anon_bytes() -> int:
    """Anonymous resident memory (``RssAnon``): the process's own allocations, not the library
    code and files it has mapped."""
    return _meminfo("RssAnon", "/proc/self/status") or 0


def peak_anon_bytes() -> int:
    """The peak of anonymous memory since the last :func:`reset_peak_rss`, as ``VmHWM`` minus the
    file-backed and shared pages resident now. Running new code paths (generate, backward
    kernels) faults in pages of ``libtorch`` that ``VmHWM`` counts but no tensor uses; they stay
    resident, so subtracting the present ones leaves the anonymous peak (slightly under it if
    file pages were dropped since)."""
    status = "/proc/self/status"
    return peak_rss_bytes() - (_meminfo("RssFile", status) or 0) - (_meminfo("RssShmem", status) or 0)


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _fmt(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if abs(n) >= GiB / 4 else f"{n / 2**20:,.1f} MiB"


def format_plan(plan: MemoryPlan, device_bytes: int | None = None, device: str = "device") -> str:
    """A table of every component (grouped by phase) and the total per device."""
    s = plan.settings
    rows = [
        "GRPO memory plan (per device, worst case: every completion at max_completion_length)",
        f"  {s.strategy} x{s.world_size}, precision {s.precision}, optimizer {s.optimizer}, micro-batch {s.rows} rows x "
        f"({s.prompt_length} prompt + {s.completion_length} completion) tokens, gradient checkpointing "
        f"{'on' if s.gradient_checkpointing else 'off'}, LM head {'chunked' if s.chunked_lm_head else 'full logits'}",
    ]
    width = max(len(line.name) for line in plan.lines)
    peak = plan.peak_phase
    for phase in ("persistent", "backward to step", "training", "logprobs", "generation", "optimizer step"):
        lines = [line for line in plan.lines if line.phase == phase]
        if not lines:
            continue
        mark = " (peak phase)" if phase == peak else ""
        rows.append(f"  [{phase}]{mark}  {_fmt(sum(line.bytes for line in lines))}")
        rows += [f"    {line.name:<{width}}  {_fmt(line.bytes):>12}   {line.formula}" for line in lines]
    resident = f"persistent {_fmt(plan.persistent)}"
    if plan.resident(peak) != plan.persistent:
        resident += f" + backward to step {_fmt(plan.resident(peak) - plan.persistent)}"
    total = f"  total: {_fmt(plan.total)} = {resident} + {peak} {_fmt(plan.phase_bytes(peak))}"
    if device_bytes:
        total += f"; {device}: {_fmt(device_bytes)} ({100 * plan.total / device_bytes:.0f} %)"
    rows.append(total)
    rows += [f"  note: {note}" for note in plan.notes]
    return "\n".join(rows)


def _largest_fitting(low: int, high: int, total_at: Callable[[int], int], budget: int) -> int | None:
    """The largest value in ``[low, high]`` whose estimate fits (estimates grow with the value)."""
    if total_at(low) > budget:
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if total_at(mid) <= budget else (low, mid - 1)
    return low


def remedies(plan: MemoryPlan, budget: int) -> list[Remedy]:
    """Settings that lower the peak, the ones that fit ``budget`` first, then by the peak they leave."""
    s, shape = plan.settings, plan.shape
    total_of = lambda **changes: estimate_memory(shape, replace(s, **changes)).total  # noqa: E731
    out: list[Remedy] = []
    if not s.gradient_checkpointing:
        out.append(Remedy("turn model.gradient_checkpointing on", total_of(gradient_checkpointing=True)))
    if not s.chunked_lm_head:
        out.append(Remedy("set model.forward.chunked_lm_head: true", total_of(chunked_lm_head=True)))
    seq = s.prompt_length + s.completion_length
    if s.rows > 1 and plan.peak_phase == "training":
        tokens = s.rows * seq if s.train_token_budget is None else min(s.train_token_budget, s.rows * seq)
        best = _largest_fitting(seq, tokens, lambda b: total_of(train_token_budget=b), budget)
        value = best // seq * seq if best else seq
        out.append(Remedy(f"set model.forward.train_token_budget: {value} (same loss, one forward+backward per "
                          f"{value // seq} rows)", total_of(train_token_budget=value)))
        rows = _largest_fitting(1, s.rows, lambda r: total_of(rows=r), budget) or 1
        out.append(Remedy(f"lower data.per_device_train_batch_size to {rows} (raise trainer.accumulate_grad_batches "
                          "to keep the step)", total_of(rows=rows)))
    if s.chunked_lm_head and s.lm_head_chunk_tokens > 256 and plan.peak_phase == "training":
        out.append(Remedy("lower model.forward.lm_head_chunk_tokens to 256", total_of(lm_head_chunk_tokens=256)))
    if s.world_size > 1 and s.strategy in ("ddp", "single", "deepspeed_stage_1", "deepspeed_stage_2"):
        out.append(Remedy("use trainer.strategy: fsdp2 (ModelParallelStrategy: weights, gradients and optimizer "
                          "states divided by the world size)", total_of(strategy="fsdp2")))
    if s.precision == "32-true" and s.param_bytes == 4:
        out.append(Remedy("set trainer.precision: bf16-mixed (16-bit activations)", total_of(precision="bf16-mixed")))
    if s.optimizer == "adamw":
        out.append(Remedy("use an 8-bit AdamW (model.optimizer: bitsandbytes.optim.AdamW8bit)", total_of(optimizer="adamw_8bit")))
    if s.logprob_rows and plan.peak_phase == "logprobs":
        value = max(seq, s.logprob_rows * seq // 4)
        out.append(Remedy(f"set model.forward.logprob_token_budget: {value}", total_of(logprob_token_budget=value)))
    if s.sampler == "hf" and plan.peak_phase == "generation":
        g = s.generation_rows or s.rows
        rows = _largest_fitting(1, g, lambda r: total_of(generation_rows=r), budget) or 1
        out.append(Remedy(f"set data.sampler.init_args.max_batch_rows: {rows} (smaller generate calls, smaller KV cache)",
                          total_of(generation_rows=rows)))
    if s.sampler == "vllm_colocate" and s.vllm_kv_cache_bytes is None:
        lower = max(0.05, round(s.vllm_gpu_memory_utilization / 2, 2))
        out.append(Remedy(f"lower data.sampler.init_args.gpu_memory_utilization to {lower}",
                          total_of(vllm_gpu_memory_utilization=lower)))
        if not s.vllm_sleep_mode:
            out.append(Remedy("set data.sampler.init_args.enable_sleep_mode: true", total_of(vllm_sleep_mode=True)))
    if s.reference:
        out.append(Remedy("drop the reference model: loss beta 0 (changes the objective) or a PEFT adapter",
                          total_of(reference=False)))
    out = [r for r in out if r.total < plan.total]
    return sorted(out, key=lambda r: (not r.fits(budget), r.total))


def memory_warning(plan: MemoryPlan, device_bytes: int | None, device: str = "device", headroom: float = 0.9) -> str | None:
    """A warning naming the settings to change when the estimate exceeds ``headroom`` of the device
    (the rest goes to the allocator's fragmentation, the CUDA context and kernels' workspaces)."""
    if not device_bytes or plan.total <= headroom * device_bytes:
        return None
    budget = int(headroom * device_bytes)
    found = remedies(plan, budget)
    lines = [
        f"Estimated peak memory {_fmt(plan.total)} exceeds {headroom:.0%} of {device} ({_fmt(device_bytes)}); "
        f"the largest part is {plan.peak_phase}. Change one of:"
    ]
    for remedy in found[:4]:
        lines.append(f"  - {remedy.setting}: peak {_fmt(remedy.total)}{'' if remedy.fits(budget) else ' (still over)'}")
    if not found:
        lines.append("  - no single setting brings it down: use more devices with a sharding strategy")
    return "\n".join(lines)

"""Where a process's host memory peaks: a sampling thread that names the code on the way up.

``ru_maxrss`` says how high a process's resident memory went, not what put it there, and the
per-phase RSS of ``bench_child.py`` only says in which phase. :class:`RssWatch` reads
``/proc/self/status`` every ``interval_s`` on a daemon thread; each time the resident set passes
its previous maximum by ``step_mb`` it keeps a *rise*: the RSS split into anonymous memory (the
process's own allocations: tensors, malloc), file-backed pages (mapped libraries and weight
files) and shared memory, the phase the benchmark was in, the pinned host memory CUDA's caching
host allocator holds (when CUDA is initialised), and the innermost Python frames of the main
thread at that moment: the line that was allocating. The peak itself is kept the same way.

    watch = RssWatch().start()
    watch.phase = "generation"
    ...
    report = watch.stop()      # {"peak": {...}, "rises": [{...}, ...], "max_rss_mb": x, "samples": n}

Sampling costs one small file read per interval (20 ms by default): nothing a step would notice.
A rise shorter than the interval can be missed; the per-phase ``ru_maxrss`` values catch those.
Linux only (``/proc``); elsewhere the report says it is unavailable.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

_FIELDS = {"VmRSS": "rss_mb", "RssAnon": "anon_mb", "RssFile": "file_mb", "RssShmem": "shmem_mb"}


def read_status(path: str = "/proc/self/status") -> dict[str, float]:
    """``{"rss_mb", "anon_mb", "file_mb", "shmem_mb"}`` of this process now (MB); ``{}`` without /proc."""
    out: dict[str, float] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in _FIELDS:
                    out[_FIELDS[key]] = int(value.split()[0]) / 1024  # the kernel reports kB
    except OSError:
        return {}
    return out


def pinned_host_mb() -> float | None:
    """Pinned host memory held by torch's CUDA caching host allocator (MB), ``None`` where CUDA
    is not initialised or this torch has no ``torch.cuda.host_memory_stats``."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    try:
        stats = torch.cuda.host_memory_stats()
    except RuntimeError:
        return None
    for key in ("reserved_bytes.current", "allocated_bytes.current", "allocated_bytes.all.current"):
        if key in stats:
            return stats[key] / 2**20
    return None


class RssWatch:
    """Samples this process's resident memory on a thread; keeps each rise with the main thread's
    stack (see the module docstring).

    Args:
        interval_s: Seconds between samples.
        step_mb: A new rise is kept when the RSS passes the last kept one by this much.
        frames: Innermost frames of the main thread kept with each rise.
        max_rises: Rises kept (the first ones: the growth, not its noise); the peak is always kept.
        noise_mb: The peak's record (its stack) moves only when the RSS passes it by more than this:
            the pages a process touches after its big allocation returned must not credit the
            peak to whatever code runs then. ``max_rss_mb`` in the report is the exact maximum.
    """

    def __init__(self, interval_s: float = 0.02, step_mb: float = 256.0, frames: int = 14, max_rises: int = 40,
                 noise_mb: float = 16.0) -> None:
        self.interval_s, self.step_mb, self.frames, self.max_rises = interval_s, step_mb, frames, max_rises
        self.noise_mb = noise_mb
        self.max_rss_mb = 0.0
        self.phase = "startup"
        self.rises: list[dict] = []
        self.peak: dict | None = None
        self.samples = 0
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def start(self) -> "RssWatch":
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="rss-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stops sampling; returns ``{"available", "samples", "max_rss_mb", "peak", "rises"}``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)
        if self.peak is None:  # a run shorter than one interval: one reading (the stack is stop()'s)
            self.sample()
        return {"available": self.peak is not None, "samples": self.samples, "max_rss_mb": self.max_rss_mb,
                "peak": self.peak, "rises": self.rises}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """One reading: keeps it as the peak and/or a rise when it is one."""
        status = read_status()
        if not status:
            return
        self.samples += 1
        rss = status["rss_mb"]
        self.max_rss_mb = max(self.max_rss_mb, rss)
        if self.peak is not None and rss <= self.peak["rss_mb"] + self.noise_mb:
            return
        record = self._record(status)
        self.peak = record
        last = self.rises[-1]["rss_mb"] if self.rises else None
        if (last is None or rss >= last + self.step_mb) and len(self.rises) < self.max_rises:
            self.rises.append(record)

    def _record(self, status: dict[str, float]) -> dict:
        record = {**{k: round(v, 1) for k, v in status.items()}, "phase": self.phase,
                  "t_s": round(time.perf_counter() - self._started, 3)}
        pinned = pinned_host_mb()
        if pinned is not None:
            record["pinned_host_mb"] = round(pinned, 1)
        frame = sys._current_frames().get(self._main)
        if frame is not None:
            stack = traceback.extract_stack(frame)[-self.frames:]
            record["stack"] = [f"{s.filename}:{s.lineno} {s.name}: {(s.line or '').strip()}" for s in stack]
        return record


def describe(report: dict, frames: int = 6) -> str:
    """A few lines for a log: the peak, its split, its phase and where the main thread was.

    >>> describe({"available": False, "samples": 0, "peak": None, "rises": []})
    'rss-watch: /proc not available'
    """
    peak = report.get("peak")
    if not peak:
        return "rss-watch: /proc not available"
    split = ", ".join(f"{k[:-3]} {peak[k]:.0f}" for k in ("anon_mb", "file_mb", "shmem_mb", "pinned_host_mb") if k in peak)
    lines = [f"rss-watch: peak {peak['rss_mb']:.0f} MB ({split}) in phase {peak['phase']} at {peak['t_s']:.1f}s; "
             f"{len(report['rises'])} rises kept"]
    lines += ["  " + s for s in peak.get("stack", [])[-frames:]]
    return "\n".join(lines)

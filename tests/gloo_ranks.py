"""Two gloo ranks in child processes, for tests of sharded code that need no Lightning Trainer.

A test calls :func:`run_two_ranks` with a child script; the script's ``__main__`` calls
:func:`spawn_two_ranks` with a check ``fn(rank) -> list[str]`` (the problems found, empty when all
is well). Each rank writes ``rank<r>.txt`` ("ok" or its problems), then both meet at a barrier
before the group is destroyed, so neither rank closes its connections while the other still has
a message in flight (a gloo peer that loses its connection mid-receive aborts the process); with
``hard_exit`` a rank that got there leaves at once (``os._exit``), skipping the interpreter's
teardown. A rank that dies anyway prints every thread's Python stack (``faulthandler``), which
the test shows.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rank_main(rank: int, fn: Callable[[int], list[str]], port: int, out_dir: str, hard_exit: bool) -> None:
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        problems = fn(rank)
        Path(out_dir, f"rank{rank}.txt").write_text("\n".join(problems) or "ok")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if hard_exit:
        # Done, verdict written: leave without the interpreter's teardown, where a C++ thread of
        # FSDP2 that is still joinable now and then aborts the process ("terminate called without
        # an active exception", no Python frame left: CI lost rank 1 of the FSDP2 child to it twice).
        # Not the default: the teardown is where vLLM unlinks its shared memory (/dev/shm).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def spawn_two_ranks(fn: Callable[[int], list[str]], hard_exit: bool = False) -> None:
    """The child script's entry point: ``python child.py PORT OUT_DIR`` runs ``fn`` on 2 ranks
    (``hard_exit``: each rank leaves with ``os._exit`` once its verdict is written)."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(fn, int(sys.argv[1]), sys.argv[2], hard_exit), nprocs=2)


def run_two_ranks(child: Path, out_dir: Path, *args: str) -> None:
    """Run ``child`` (a script ending in :func:`spawn_two_ranks`; ``args`` follow its PORT and
    OUT_DIR) and assert both ranks say "ok"."""
    from tests.helpers import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(child), str(free_port()), str(out_dir), *args], capture_output=True,
                            text=True, timeout=300, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    for rank in (0, 1):
        assert (out_dir / f"rank{rank}.txt").read_text() == "ok", (rank, result.stderr[-3000:])

"""A process-wide asyncio event loop running in a daemon thread, started lazily.

Async reward functions (and, later, async tools) run here so that synchronous training code can
run several coroutines concurrently and block until they finish, as TRL does with its
``start_event_loop_in_daemon``. The loop is created on first use, restarted in a forked child
(threads do not survive ``fork``), and stopped at interpreter exit.

Layer L0: standard library only.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
from typing import Any, Awaitable, Coroutine, Iterable, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_owner_pid: int | None = None
_atexit_registered = False


def get_loop() -> asyncio.AbstractEventLoop:
    """Return the background event loop, starting its daemon thread if needed.

    Returns:
        The running event loop owned by the ``grpo-lightning-async`` daemon thread.
    """
    global _loop, _thread, _owner_pid, _atexit_registered
    with _lock:
        alive = _loop is not None and _thread is not None and _thread.is_alive()
        if alive and _owner_pid == os.getpid():
            return _loop  # type: ignore[return-value]
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def _run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=_run, name="grpo-lightning-async", daemon=True)
        thread.start()
        ready.wait()
        _loop, _thread, _owner_pid = loop, thread, os.getpid()
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        return loop


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run one coroutine on the background loop and block until it returns.

    Args:
        coro: The coroutine to run.
        timeout: Seconds to wait before raising ``TimeoutError``; ``None`` waits forever.

    Returns:
        The coroutine's result; its exception, if any, is re-raised here.

    Raises:
        RuntimeError: When called from the background loop's own thread (it would deadlock).
    """
    return submit(coro).result(timeout)


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule one coroutine on the background loop without waiting for it.

    Args:
        coro: The coroutine to run.

    Returns:
        A thread-safe future of its result; cancelling the future cancels the coroutine's task.

    Raises:
        RuntimeError: When called from the background loop's own thread (waiting on the future
            there would deadlock).
    """
    loop = get_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError(
            "grpo_lightning.utils.async_loop was asked to run a coroutine from inside the "
            "background event loop; await the coroutine instead."
        )
    return asyncio.run_coroutine_threadsafe(coro, loop)


def gather(coros: Iterable[Awaitable[T]], timeout: float | None = None) -> list[T]:
    """Run awaitables concurrently (``asyncio.gather``) on the background loop.

    Args:
        coros: The coroutines or other awaitables to run together.
        timeout: Seconds to wait for all of them; ``None`` waits forever.

    Returns:
        Their results, in the order given.
    """
    items = list(coros)
    if not items:
        return []

    async def _gather() -> list[T]:
        return list(await asyncio.gather(*items))

    return run(_gather(), timeout)


def shutdown() -> None:
    """Stop the background loop and join its thread (a later call starts a new one)."""
    global _loop, _thread, _owner_pid
    with _lock:
        loop, thread = _loop, _thread
        _loop, _thread, _owner_pid = None, None, None
    if loop is None or thread is None or not thread.is_alive():
        return
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    if not thread.is_alive():
        loop.close()

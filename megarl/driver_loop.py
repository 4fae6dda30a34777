"""One event loop for the driver's async work (generations, searches, engine control), on a
thread of its own, shared by every thread of the process.

Why not `asyncio.run` per call: with asynchronous rollouts (megarl.async_rollouts) the next
batch is generated on one thread while the trainer syncs weights from another, and the
parts they share are bound to the loop they first ran on: the embedded engine's scheduler,
the httpx clients of the engine servers and of the retriever. One long-lived loop serves
both threads; each blocking caller waits on its own future. The wait stays interruptible
(a signal's KeyboardInterrupt reaches the main thread, megarl.termination) and cancels the
coroutine it was waiting for. Main entry point: `run_async`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class DriverLoop:
    """An event loop running forever on a daemon thread (started on first use)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=serve_without_signals, args=(self._loop.run_forever,),
                                                name="megarl-driver-loop", daemon=True)
                self._thread.start()
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (its exception is raised here)."""
        if self._thread is threading.current_thread():
            coro.close()
            raise RuntimeError("run_async called from the driver loop itself; await the coroutine instead")
        future = asyncio.run_coroutine_threadsafe(coro, self._started())
        try:
            return future.result()
        except BaseException:  # KeyboardInterrupt from a signal: stop what we were waiting for
            future.cancel()
            raise


def serve_without_signals(target) -> None:
    """Run `target` with SIGINT and SIGTERM blocked in this thread (and the threads it starts):
    the kernel then delivers them to the main thread, whose blocking wait they interrupt
    (megarl.termination). A thread that may take them would leave the main thread waiting
    until its current call ended."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    target()


_loops: dict[int, DriverLoop] = {}  # by process id: a forked child gets a loop of its own


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on this process's driver loop and return its result."""
    loop = _loops.get(os.getpid())
    if loop is None:
        loop = _loops.setdefault(os.getpid(), DriverLoop())
    return loop.run(coro)

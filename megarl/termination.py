"""SIGTERM and SIGINT stop a training run the way Ctrl-C does: at once, through the run's own
cleanup (MLflow status, every part shut down), with the shell's exit status 128 + signal.

SIGTERM is what slurm sends on `scancel` and at the time limit (SIGKILL follows KillWait
seconds later, 30 by default), what `kill` and `timeout` send, and Python's default for it is
to die on the spot: no MLflow status, Ray actors and servers left to their own fate.

Why the handler raises KeyboardInterrupt rather than setting a flag the loop checks between
steps: a step runs for minutes (a DAPO step of a 32B model: tens of minutes), and the driver
spends it almost entirely in blocking waits: ray.wait / ray.get, asyncio.run over the HTTP
generations, the reward pool's pipes. A flag would be seen only after the step, long after
SIGKILL. Python runs a handler in the main thread between bytecodes, and those waits return to
run it: ray.get and ray.wait check for signals while they wait (that is how Ctrl-C stops them),
the selectors and sleeps retry after the handler and propagate what it raises (PEP 475). Why
KeyboardInterrupt and no exception of our own: every layer in between already treats it as
"stop now": asyncio re-raises it out of a task instead of keeping it in the task, and Ray's
signal check inside a blocking get catches KeyboardInterrupt only (anything else raised there
is lost). Those layers may replace the exception object, so which signal it was is kept here,
and `stop_on_signals` re-raises it as `Stopped(signum)` once the run's cleanup is done.

Two moments must not be cut in half. A checkpoint being written (`deferred`): a first signal
is held until it is complete, then raised (saving the same step again moves the old directory
aside before the new one takes its name; cut there, that step would be gone). If the checkpoint
fails after the signal came, that is the stop too, not a failed run: a preemption signals every
process of the job, Ray's stop at once, and the checkpoint's writers go with them. And the cleanup
itself (`closing`): it is bounded in time, but a signal during it (the second, when the first
stopped the run) cuts it short: every process descended from this one is killed at once (Ray
actors on other nodes end with the driver, as Ray ends a job's actors). A SIGTERM within
REPEAT_WINDOW_S of the first is the same request delivered twice (slurm signals every process
of the job and tools/ray_on_slurm.sh passes on what the batch shell receives) and is ignored.

Main entry points: `stop_on_signals` (decorates `megarl.train.train`), `deferred`, `closing`,
`handlers_kept` (around ray.init), `Stopped`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 2.0  # a SIGTERM this soon after the first one is the same request
KILL_WAIT_S = 10.0  # for the killed processes to be gone (SIGKILL: no handler runs)

T = TypeVar("T")


class Stopped(KeyboardInterrupt):
    """The run was stopped by the signal `signum`; its cleanup has run."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


class _State:
    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal
        self.at = 0.0  # when it came (time.monotonic)
        self.deferring = 0  # depth of `deferred` blocks
        self.pending = False  # the first signal came inside one: raised when it ends
        self.closing = False  # the cleanup has begun: a signal now cuts it short
        self.forcing = False  # killing what is left: later signals are only noted
        self.installed: set[int] = set()  # the signals handled here


_state = _State()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def received() -> str | None:
    """The name of the signal that stopped the run (SIGTERM, SIGINT), if one did."""
    return None if _state.signum is None else signal_name(_state.signum)


def _on_signal(signum: int, frame) -> None:
    s, now = _state, time.monotonic()
    if s.signum is None:
        s.signum, s.at = signum, now
        if s.deferring and not s.closing:
            s.pending = True
            log.warning("%s: stopping once the checkpoint being written is complete (another signal stops at once)",
                        signal_name(signum))
            return
        raise KeyboardInterrupt
    if s.forcing or (signum == s.signum == signal.SIGTERM and now - s.at < REPEAT_WINDOW_S):
        return
    s.pending = False
    raise KeyboardInterrupt


def stop_on_signals(run: Callable[..., T]) -> Callable[..., T]:
    """Run `run` with SIGTERM and SIGINT raising KeyboardInterrupt (module docstring); what
    escapes it because of a signal is `Stopped(signum)`. The previous handlers come back after.
    A signal ignored when the run starts (SIGINT of a background job in a script) stays ignored.
    Off the main thread (where Python delivers no signal) `run` is only called."""

    @functools.wraps(run)
    def with_handlers(*args, **kwargs) -> T:
        global _state
        if threading.current_thread() is not threading.main_thread():
            return run(*args, **kwargs)
        _state = _State()
        previous = {s: signal.getsignal(s) for s in SIGNALS}
        _state.installed = {s for s, handler in previous.items() if handler is not signal.SIG_IGN}
        for s in _state.installed:
            signal.signal(s, _on_signal)
        # a mask inherited from whoever started us (Ray starts processes with SIGINT blocked) or set
        # by a library would hold the signals back: this thread takes them while the run goes on
        mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, _state.installed)
        try:
            return run(*args, **kwargs)
        except KeyboardInterrupt as e:
            if _state.signum is not None and not isinstance(e, Stopped):
                raise Stopped(_state.signum) from None
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for s in _state.installed:
                handler = previous[s]
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
            _state.installed = set()  # nothing for reclaim_handlers to put back once the run is over

    return with_handlers


def reclaim_handlers() -> None:
    """After a call that installed handlers of its own (ray.init makes SIGTERM sys.exit(15)):
    those of `stop_on_signals` again, while a run it started is going on."""
    if threading.current_thread() is threading.main_thread():
        for s in _state.installed:
            signal.signal(s, _on_signal)


@contextlib.contextmanager
def handlers_kept() -> Iterator[None]:
    """Around a call that installs handlers of its own: `reclaim_handlers` as soon as it ends."""
    try:
        yield
    finally:
        reclaim_handlers()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A block a first signal does not cut in half (a checkpoint being written): the signal is
    noted and raised as KeyboardInterrupt when the block ends; a second one raises at once.
    The block failing after the first signal came is the stop too (KeyboardInterrupt, the failure
    logged): a preemption signals the other processes of the job as well, and Ray's, stopping at
    once, take the checkpoint's writers with them; the run resumes from the newest whole one."""
    _state.deferring += 1
    try:
        yield
    except Exception as e:
        if not (_state.pending and _state.deferring == 1):
            raise
        _state.pending = False
        log.warning("%s came while a checkpoint was being written, and the checkpoint then failed (a "
                    "preemption stops the job's other processes too): %s: %s; stopping",
                    received(), type(e).__name__, e)
        raise KeyboardInterrupt from e
    finally:
        _state.deferring -= 1
    if _state.pending and not _state.deferring:
        _state.pending = False
        raise KeyboardInterrupt


@contextlib.contextmanager
def closing() -> Iterator[None]:
    """The run's cleanup (MLflow status, then the runtime's bounded shutdown). A signal during it
    kills every process descended from this one at once and ends the block; the exception that
    started the cleanup, if any, goes on."""
    _state.closing = True
    try:
        yield
    except KeyboardInterrupt:
        _state.forcing = True
        log.warning("%s during the shutdown: killing the run's remaining processes now", received() or "SIGINT")
        kill_descendants()


def kill_descendants() -> list[int]:
    """SIGKILL every process descended from this one (found through their parent ids, each
    killed by its own id) and wait for them; their ids."""
    import psutil

    found = psutil.Process().children(recursive=True)
    for process in found:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    alive, deadline = found, time.monotonic() + KILL_WAIT_S
    while alive and time.monotonic() < deadline:
        _, alive = psutil.wait_procs(alive, timeout=0.2)  # reaps our own children
        alive = [p for p in alive if _status(p) != psutil.STATUS_ZOMBIE]  # a grandchild's zombie is its parent's
    for process in alive:
        log.warning("process %d outlived SIGKILL for %.0f s", process.pid, KILL_WAIT_S)
    return [p.pid for p in found]


def _status(process) -> str:
    import psutil

    try:
        return process.status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_DEAD

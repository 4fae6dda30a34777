"""A wall-clock limit on one reward call, by SIGALRM in the calling process's main thread.

Main entry point: `call_with_timeout`.

Rule rewards can hang on pathological input (sympy on a 5,000-term LaTeX expression).
The alarm interrupts Python-level loops; a hang inside C code that never returns to the
interpreter cannot be interrupted from within the process, which is why the reward pool
also watches its workers from the outside and kills the ones that stop answering.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class RewardTimeout(BaseException):
    """Raised in the main thread when a reward call runs past its limit.

    A BaseException, not an Exception, because the reward libraries catch Exception
    broadly (math-verify's parse returns [] on any Exception) and would otherwise turn
    the timeout into a silent wrong answer and keep running.
    """


def alarm_available() -> bool:
    """Signals can only be handled in the main thread of the main interpreter."""
    return threading.current_thread() is threading.main_thread()


def call_with_timeout(fn: Callable[[], T], timeout_s: float | None) -> T:
    """fn() under a SIGALRM timer of timeout_s seconds; raises RewardTimeout when it fires.

    Runs fn without a limit when timeout_s is None or when called off the main thread
    (where signals cannot be handled). The previous SIGALRM handler and timer are restored.
    """
    if timeout_s is None or not alarm_available():
        return fn()
    armed = True

    def on_alarm(signum, frame):
        # Disarmed first thing in `finally`: an alarm that lands during the clean-up must
        # not escape into the caller's code after the guarded call is over.
        if armed:
            raise RewardTimeout(f"reward call exceeded {timeout_s} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn()
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:
            # Put back a timer that was running before (e.g. pytest-timeout's), minus the
            # time spent here; one already due fires right away.
            remaining = outer_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-3), outer_interval)

"""The SIGALRM guard around one reward call."""

import signal
import threading
import time

import pytest

from megarl.reward.timeout import RewardTimeout, call_with_timeout


def spin_forever():
    while True:
        pass


def swallow_exceptions_forever():
    # like math-verify's `except Exception`: the timeout must still get through
    while True:
        try:
            time.sleep(0.01)
        except Exception:
            pass


@pytest.mark.parametrize("hang", [spin_forever, swallow_exceptions_forever])
def test_python_level_hang_times_out(hang):
    started = time.monotonic()
    with pytest.raises(RewardTimeout):
        call_with_timeout(hang, 0.2)
    assert 0.15 < time.monotonic() - started < 1.0


def test_result_passes_through_and_handler_and_timer_are_restored():
    def previous_handler(signum, frame):
        raise AssertionError("the outer timer fired during the test")

    old = signal.signal(signal.SIGALRM, previous_handler)
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        assert call_with_timeout(lambda: 7, 0.5) == 7
        assert signal.getsignal(signal.SIGALRM) is previous_handler
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0  # the outer timer is running again
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_no_limit_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(call_with_timeout(lambda: "done", 0.1)))
    thread.start()
    thread.join()
    assert results == ["done"]


def test_none_means_no_limit():
    assert call_with_timeout(lambda: 1, None) == 1

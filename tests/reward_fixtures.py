"""Custom reward functions for the reward tests, referenced as "reward_fixtures:<name>".

A module of its own (not a test file) because reward workers are fresh processes that
import custom functions by name; pytest puts tests/ on sys.path and spawned workers
inherit the parent's sys.path. Each function has the custom-function signature
fn(data_source, solution_str, ground_truth, extra_info=None) and acts on the response
text, so one batch can mix well-behaved and misbehaving requests.
"""

import signal
import time

HANG_SECONDS = 60


def length_score(data_source, solution_str, ground_truth, extra_info=None):
    """len(response) / 100, correct when it equals ground_truth characters exactly."""
    return {"score": len(solution_str) / 100, "acc": len(solution_str) == int(ground_truth), "pred": solution_str[:10]}


def misbehaving_score(data_source, solution_str, ground_truth, extra_info=None):
    """'loop' spins in Python, 'c-hang' sleeps with SIGALRM blocked (a hang the alarm
    cannot interrupt), 'raise' raises, 'crash' kills its process; anything else scores
    like length_score."""
    if solution_str == "loop":
        while True:
            pass
    if solution_str == "c-hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(HANG_SECONDS)
    if solution_str == "raise":
        raise ZeroDivisionError("reward fixture raised on purpose")
    if solution_str == "crash":
        import os

        os._exit(3)
    return length_score(data_source, solution_str, ground_truth, extra_info)


def float_score(data_source, solution_str, ground_truth, extra_info=None):
    """A custom function may return a bare number."""
    return 0.5 if solution_str == ground_truth else -0.5


def wrong_type_score(data_source, solution_str, ground_truth, extra_info=None):
    return "not a score"


NOT_A_FUNCTION = 42


def odd_prompts_constant(data_source, solution_str, ground_truth, extra_info=None):
    """Even-indexed prompts: a score that varies with the response; odd ones: always 0
    (their groups carry no signal and dynamic sampling must drop them)."""
    if extra_info["index"] % 2:
        return {"score": 0.0, "acc": False}
    correct = sum(map(ord, solution_str)) % 2 == 0
    return {"score": float(correct), "acc": correct}


def scorer_shaped(solution_str, ground_truth, extra_info=None):
    """A built-in scorer's signature, not a custom function's: refused when the run starts."""
    return 1.0


def keyword_only_score(*, data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def flexible_score(data_source, *rest, **options):
    """Any function that takes the four positional arguments is accepted."""
    return float(len(rest) == 3)

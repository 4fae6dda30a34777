"""A reward that notes each call and takes its time, so that a test can signal a run while a
step is under way. Referenced as "slow_reward:noted_slow_score" (reward workers import it by
name; tests/ is on their path). MEGARL_TEST_REWARD_LOG: a file that gets one line per call;
MEGARL_TEST_REWARD_SLEEP: seconds each call takes (default 0)."""

import os
import time


def noted_slow_score(data_source, solution_str, ground_truth, extra_info=None):
    log = os.environ.get("MEGARL_TEST_REWARD_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
    time.sleep(float(os.environ.get("MEGARL_TEST_REWARD_SLEEP", "0")))
    return {"score": float(len(solution_str) % 2), "acc": False}

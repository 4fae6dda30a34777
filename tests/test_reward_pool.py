"""RewardPool: same results as serial scoring, in order, one per request; hangs, crashes
and exceptions are scored 0, counted, logged, and never stop the batch."""

import logging
import time

import pytest

import reward_fixtures
from megarl.reward.pool import RewardPool
from megarl.config import load_config
from megarl.reward.scoring import RewardRequest
from megarl.reward.settings import RewardConfig

FIXTURES = reward_fixtures.__name__
MISBEHAVING = RewardConfig(custom_function=f"{FIXTURES}:misbehaving_score")
TIMEOUT_S, GRACE_S = 0.5, 0.5


def mixed_requests(n: int) -> list[RewardRequest]:
    """Search-R1 and DAPO requests, right, wrong and malformed, in groups of 4."""
    templates = [
        ("nq", "<think>t</think><answer>Paris</answer>", {"target": ["Paris"]}),
        ("hotpotqa", "<answer>Lyon</answer>", {"target": ["Paris"]}),
        ("popqa", "<answer>Paris", {"target": ["Paris"]}),
        ("math_dapo", "work\nAnswer: \\boxed{1,000}", "1000"),
        ("aime24", "Answer: 12", "13"),
        ("math", "no final line", "7"),
    ]
    requests = []
    for i in range(n):
        data_source, response, ground_truth = templates[i % len(templates)]
        requests.append(RewardRequest(data_source, response + " " * (i % 5), ground_truth, group_id=i // 4,
                                      response_length=10 + i % 7))
    return requests


def test_pool_results_equal_serial_results_in_order():
    # weights with task_score (routed) and the group-level len component
    spec = RewardConfig(weights={"task_score": 1.0, "len": 0.5, "tag_count": 0.1}, format_score=0.1)
    requests = mixed_requests(120)
    with RewardPool(spec, num_workers=0) as serial:
        expected, serial_stats = serial.compute(requests)
    with RewardPool(spec, num_workers=2, chunk_size=7) as pool:
        results, stats = pool.compute(requests)
        again, _ = pool.compute(requests[:4])  # the pool is persistent; one whole group
    assert results == expected
    assert again == expected[:4]
    assert (stats.num_requests, stats.num_timeouts, stats.num_errors) == (120, 0, 0)
    assert serial_stats.num_requests == 120
    assert {r.components["len"] is not None for r in results} == {True}


def test_empty_batch():
    with RewardPool(RewardConfig(), num_workers=1) as pool:
        results, stats = pool.compute([])
    assert results == [] and stats.num_requests == 0


def requests_for(responses: list[str]) -> list[RewardRequest]:
    return [RewardRequest("custom", response, "1") for response in responses]


def scores(results) -> list[float]:
    return [round(r.score, 6) for r in results]


def test_python_level_hang_is_a_counted_timeout():
    started = time.monotonic()
    with RewardPool(MISBEHAVING, num_workers=2, timeout_s=TIMEOUT_S, grace_s=GRACE_S) as pool:
        started = time.monotonic()
        results, stats = pool.compute(requests_for(["a", "loop", "bb", "loop", "ccc"]))
        elapsed = time.monotonic() - started
    assert scores(results) == [0.01, 0.0, 0.02, 0.0, 0.03]
    assert [r.timed_out for r in results] == [False, True, False, True, False]
    assert (stats.num_timeouts, stats.num_errors, stats.num_workers_replaced) == (2, 0, 0)
    assert elapsed < TIMEOUT_S + GRACE_S + 1.0  # the two hangs ran side by side


def test_c_level_hang_kills_and_replaces_the_worker():
    # one worker, one chunk: the hang sits in the middle. Results travel in batches, so the
    # worker's unsent results are lost with it: its requests are re-sent one by one, the hang
    # stalls a second (lone) worker, and only then is the request to blame known.
    responses = ["a", "c-hang", "bb", "ccc", "dddd"]
    with RewardPool(MISBEHAVING, num_workers=1, timeout_s=TIMEOUT_S, grace_s=GRACE_S, chunk_size=5) as pool:
        started = time.monotonic()
        results, stats = pool.compute(requests_for(responses))
        elapsed = time.monotonic() - started
        later, later_stats = pool.compute(requests_for(["eeeee"]))  # the replacement keeps working
    assert scores(results) == [0.01, 0.0, 0.02, 0.03, 0.04]
    assert results[1].timed_out and "killed" in results[1].error
    assert (stats.num_timeouts, stats.num_errors, stats.num_workers_replaced) == (1, 0, 2)
    assert elapsed < 2 * (TIMEOUT_S + GRACE_S) + 10.0  # + two fresh workers' start-up
    assert scores(later) == [0.05] and later_stats.num_workers_replaced == 0


def test_exception_and_crash_are_counted_errors_and_logged(caplog):
    responses = ["a", "raise", "bb", "crash", "ccc", "raise", "raise"]
    with caplog.at_level(logging.WARNING, logger="megarl.reward.pool"):
        with RewardPool(MISBEHAVING, num_workers=2, timeout_s=TIMEOUT_S, grace_s=GRACE_S, chunk_size=2) as pool:
            results, stats = pool.compute(requests_for(responses))
    assert scores(results) == [0.01, 0.0, 0.02, 0.0, 0.03, 0.0, 0.0]
    assert "ZeroDivisionError: reward fixture raised on purpose" == results[1].error
    assert "died (exit code 3)" in results[3].error
    # the crash takes the unsent result of "bb" with it: both are re-sent alone, and the
    # crash kills a second worker before it is pinned on request 3
    assert (stats.num_timeouts, stats.num_errors, stats.num_workers_replaced) == (0, 4, 2)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 4  # the first three failures, then how many more
    assert "request 1" in warnings[0] and "ZeroDivisionError" in warnings[0]
    assert warnings[-1] == "1 more reward failures in this batch"


def test_serial_mode_uses_the_same_guard():
    with RewardPool(MISBEHAVING, num_workers=0, timeout_s=TIMEOUT_S) as pool:
        results, stats = pool.compute(requests_for(["a", "loop", "raise", "bb"]))
    assert scores(results) == [0.01, 0.0, 0.0, 0.02]
    assert (stats.num_timeouts, stats.num_errors) == (1, 1)


def test_bad_custom_function_fails_at_construction_in_the_caller():
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        RewardPool(RewardConfig(custom_function="no_such_module_xyz:score"), num_workers=2)
    # a function of another signature stops the run as it starts, not with a zero on every sample
    with pytest.raises(ValueError, match=r"reward_fixtures:scorer_shaped' takes \(solution_str, ground_truth"):
        RewardPool(RewardConfig(custom_function=f"{FIXTURES}:scorer_shaped"), num_workers=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_workers": -1}, "num_workers=-1"),
        ({"num_workers": 1, "timeout_s": 0}, "timeout_s=0"),
        ({"num_workers": 1, "chunk_size": 0}, "chunk_size=0"),
        ({"num_workers": 1, "start_method": "fork"}, "'fork' can deadlock"),
    ],
)
def test_pool_argument_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardPool(RewardConfig(), **kwargs)


def test_pool_takes_the_run_configs_reward_section():
    cfg = load_config(None, ["reward.custom_function=search_r1_format", "reward.structure_format_score=0.2"])
    with RewardPool(cfg.reward, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s) as pool:
        (result,), _ = pool.compute([RewardRequest("my_qa", "<answer>Paris</answer>", "Paris")])
    assert (result.score, result.acc) == (pytest.approx(0.8), True)  # 1 - structure_format_score


def test_settings_changed_after_they_were_built_are_checked_by_the_pool():
    cfg = RewardConfig()
    cfg.weights = {"soft_overlong": 1.0}
    with pytest.raises(ValueError, match="the overlong penalty is algorithm.overlong"):
        RewardPool(cfg, num_workers=0)


def test_compute_after_close_says_so():
    pool = RewardPool(RewardConfig(), num_workers=1)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        pool.compute(requests_for(["a"]))

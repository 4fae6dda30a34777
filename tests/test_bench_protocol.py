"""tools/bench/protocol.py: warm-ups untimed, the contenders' order alternated, equal work
checked, the ratio's median and range (a fake clock: each call's duration is set by hand)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
from protocol import Measured, compare  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def contender(clock: Clock, name: str, durations: list[float], calls: list[str], work: float = 10.0):
    """A contender whose k-th call takes durations[k] on `clock`."""
    def run():
        clock.now += durations[len([c for c in calls if c == name])]
        calls.append(name)
        return work
    return run


def test_warm_up_then_alternate_and_take_the_median():
    clock, calls, lines = Clock(), [], []
    # call 0 is the warm-up (untimed: it may take anything); then 3 timed runs each
    base = contender(clock, "base", [100.0, 2.0, 3.0, 4.0], calls)
    new = contender(clock, "new", [100.0, 1.0, 1.0, 4.0], calls)
    result = compare({"base": base, "new": new}, clock=clock, show=lines.append)
    assert calls == ["base", "new", "base", "new", "new", "base", "base", "new"]  # warm-up, then F, B, F
    assert result.seconds == {"base": [2.0, 3.0, 4.0], "new": [1.0, 1.0, 4.0]}
    assert result.ratio("base", "new") == [2.0, 3.0, 1.0]
    assert result.summary("base", "new") == "new vs base: 2.00x (median of 3 alternating runs; range 1.00-3.00x)"
    assert lines[0].startswith("versions: python ")


def test_unequal_work_stops_the_comparison_by_name():
    clock, calls = Clock(), []
    with pytest.raises(AssertionError, match=r"unequal work: \{'base': \[10.0, 10.0, 10.0\], 'new': \[9.0"):
        compare({"base": contender(clock, "base", [1.0] * 4, calls),
                 "new": contender(clock, "new", [1.0] * 4, calls, work=9.0)}, clock=clock, show=lambda _: None)
    # within a stated tolerance (work equal in expectation, as sampled lengths are)
    compare({"base": contender(clock, "b2", [1.0] * 4, calls), "new": contender(clock, "n2", [1.0] * 4, calls, work=9.5)},
            work_tolerance=0.06, clock=clock, show=lambda _: None)


def test_fewer_than_three_repeats_or_one_contender_is_refused():
    with pytest.raises(ValueError, match="at least 3"):
        compare({"a": lambda: 1, "b": lambda: 1}, repeats=2, show=lambda _: None)
    with pytest.raises(ValueError, match="two contenders"):
        compare({"a": lambda: 1}, show=lambda _: None)


def test_a_contender_that_times_itself_is_taken_at_its_word():
    clock, calls, lines = Clock(), [], []
    base = contender(clock, "base", [50.0] * 3, calls)
    # a run whose own steps took 10 s of the 50 its call took (its start-up left out)
    runs = iter([Measured(7.0, 10.0), Measured(7.0, 20.0), Measured(7.0, 5.0)])
    result = compare({"base": lambda: (base(), 7.0)[1], "run": lambda: next(runs)}, warmups=0, clock=clock,
                     show=lines.append, header="what is measured")
    assert result.seconds == {"base": [50.0] * 3, "run": [10.0, 20.0, 5.0]}
    assert result.summary("base", "run") == "run vs base: 5.00x (median of 3 alternating runs; range 2.50-10.00x)"
    assert lines[1] == "what is measured" and "run 2/3 run: 20.000 s, work 7" in lines


def test_work_a_second_where_the_work_differs_within_its_tolerance():
    # repeat by repeat: base 100 tokens in 10 s (10/s), new 90 tokens in 6 s (15/s): time 1.67x, tokens/s 1.50x
    runs = {"base": iter([Measured(100.0, 10.0), Measured(100.0, 10.0), Measured(100.0, 10.0)]),
            "new": iter([Measured(90.0, 6.0), Measured(95.0, 5.0), Measured(100.0, 4.0)])}
    result = compare({n: (lambda n=n: next(runs[n])) for n in runs}, warmups=0, work_tolerance=0.2,
                     show=lambda _: None)
    assert result.rate_ratio("base", "new") == pytest.approx([1.5, 1.9, 2.5])
    assert result.summary("base", "new", per="token") == ("new vs base, tokens a second: 1.90x (median of 3 "
                                                          "alternating runs; range 1.50-2.50x)")
    assert result.summary("base", "new") == "new vs base: 2.00x (median of 3 alternating runs; range 1.67-2.50x)"
    assert result.work_differs("base", "new") and not result.work_differs("base", "base")

"""One protocol for the benchmarks of tools/bench: the versions first, a warm-up of every
contender, then at least three timed repeats with the contenders' order alternated (a machine
that slows down or speeds up during a run favours neither), equal work checked, and the median
and range of the ratio printed last.

    from protocol import compare
    result = compare({"baseline": run_baseline, "megarl": run_megarl}, repeats=3)

Each contender is a function of no argument that does the work once and returns how much it did
(tokens generated, samples scored): the same amount from every contender and every repeat, or
the comparison stops, naming who did what. A contender that times itself (a training run whose
first step, its start-up, is left out) returns `Measured(work, seconds)` instead. `result.ratio("baseline", "megarl")` is the baseline's
time over megarl's, per repeat; where the work is equal only within a tolerance,
`result.rate_ratio("baseline", "megarl")` compares work a second instead (megarl's over the
baseline's), so a side that did less work is not counted faster for it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from megarl.versions import installed_versions


@dataclass(frozen=True)
class Measured:
    """What a contender that times itself returns: its work and the seconds that count."""

    work: float
    seconds: float


@dataclass
class Comparison:
    seconds: dict[str, list[float]] = field(default_factory=dict)  # contender -> one per repeat
    work: dict[str, list[float]] = field(default_factory=dict)

    def ratio(self, slower: str, faster: str) -> list[float]:
        """`slower`'s time over `faster`'s, repeat by repeat (> 1: `faster` is faster)."""
        return [s / f for s, f in zip(self.seconds[slower], self.seconds[faster], strict=True)]

    def rate_ratio(self, slower: str, faster: str) -> list[float]:
        """`faster`'s work a second over `slower`'s, repeat by repeat."""
        return [(fw / fs) / (sw / ss) for sw, ss, fw, fs in
                zip(self.work[slower], self.seconds[slower], self.work[faster], self.seconds[faster], strict=True)]

    def work_differs(self, a: str, b: str) -> bool:
        """Whether `a` and `b` did different work in any repeat."""
        return any(x != y for x, y in zip(self.work[a], self.work[b], strict=True))

    def summary(self, slower: str, faster: str, per: str = "") -> str:
        """The line a bench prints last: the median ratio and its range; with `per` (the work's
        unit, "token"), of work a second instead of time."""
        ratios = self.rate_ratio(slower, faster) if per else self.ratio(slower, faster)
        return (f"{faster} vs {slower}{f', {per}s a second' if per else ''}: {statistics.median(ratios):.2f}x "
                f"(median of {len(ratios)} alternating runs; range {min(ratios):.2f}-{max(ratios):.2f}x)")


def compare(contenders: Mapping[str, Callable[[], float | Measured]], repeats: int = 3, warmups: int = 1,
            work_tolerance: float = 0.0, clock: Callable[[], float] = time.perf_counter,
            show: Callable[[str], None] = print, header: str = "", versions: bool = True) -> Comparison:
    """Time each contender `repeats` times after `warmups` untimed runs, alternating their order
    (repeat r runs them forwards when r is even, backwards when odd). Work that differs by more
    than `work_tolerance` (relative; 0 = exactly equal) between any two runs is an error.
    `header` (what is measured) is shown after the versions (versions=False: the bench showed
    them already, before work that comes first)."""
    if repeats < 3:
        raise ValueError(f"repeats={repeats}: a median needs at least 3 timed runs of each contender")
    if len(contenders) < 2:
        raise ValueError("compare needs at least two contenders")
    if versions:
        show(installed_versions())
    if header:
        show(header)
    names = list(contenders)
    for _ in range(warmups):
        for name in names:
            contenders[name]()
    result = Comparison({n: [] for n in names}, {n: [] for n in names})
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start = clock()
            done = contenders[name]()
            seconds = clock() - start
            if isinstance(done, Measured):
                done, seconds = done.work, done.seconds
            result.seconds[name].append(seconds)
            result.work[name].append(float(done))
            show(f"run {r + 1}/{repeats} {name}: {result.seconds[name][-1]:.3f} s, work {done:g}")
    every = [(n, w) for n in names for w in result.work[n]]
    low, high = min(w for _, w in every), max(w for _, w in every)
    if high - low > work_tolerance * max(abs(high), 1e-12):
        raise AssertionError(f"unequal work: {dict(result.work)} (tolerance {work_tolerance:g})")
    return result

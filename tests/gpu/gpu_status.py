"""The first thing to run on a GPU machine: every test of tests/gpu, then one line per GPU-only
path of the table in docs/testing.md ("On a GPU machine").

    python tests/gpu/gpu_status.py [pytest options, e.g. -x or -k fp8]     (or: make test-gpu)

prints pytest's own report, then for each path of PATHS

    PASS <path>                          every test that checks it ran and passed
    FAIL <path> (<first failing test>)   one of them failed (or errored in a fixture)
    NOT RUN <path> (<why>)               none failed, but not all ran: the first skip reason
                                         (no CUDA, one GPU where two are needed, a package missing)

and a last line for the GPU tests outside the table ("other GPU tests"). A test names the paths
it checks with `@pytest.mark.gpu_path(...)` (tests/gpu/conftest.py refuses unknown names). Exit
status: 0 when every line is PASS, 1 when one is FAIL (or pytest could not collect or run the
tests), 2 otherwise (something did not run: on a machine without CUDA every line is NOT RUN).
Main entry points: `summarise` (the lines and the status, from the results), `main`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# marker name -> the row of the table in docs/testing.md ("On a GPU machine"), in its order
PATHS = {
    "te_layers": "Transformer Engine layers",
    "thd_packing": "THD packing",
    "te_cp": "TE context parallelism",
    "fp8": "FP8",
    "fp8_param_gather": "FP8 param gather",
    "optimizer_offload": "optimizer offload",
    "nccl_sync": "NCCL weight sync",
    "ipc_sync": "CUDA IPC weight sync",
    "memory_release": "memory release/resume",
    "moe_ep": "MoE with expert parallelism",
    "moe_replay": "MoE routing replay",
    "partial_rollouts": "partial rollouts on SGLang",
    "sglang_flags": "SGLang launch flags",
}
OTHER = "other GPU tests"

PASSED, FAILED, SKIPPED, DESELECTED = "passed", "failed", "skipped", "deselected"


@dataclass
class TestResult:
    """One collected test: the paths it checks (marker names), how it ended and why (a skip's reason)."""
    __test__ = False  # not a test class for pytest

    nodeid: str
    paths: tuple[str, ...]
    outcome: str = SKIPPED  # until a report says otherwise (a run stopped early by -x)
    reason: str = "did not run (the run stopped before it)"


def path_line(name: str, tests: list[TestResult], not_collected: list[str]) -> str:
    """The line of one path from the results of the tests that check it; `not_collected`: why
    some test files gave no tests (a path without tests names the first)."""
    failed = [t for t in tests if t.outcome == FAILED]
    if failed:
        return f"FAIL {name} ({failed[0].nodeid})"
    if tests and all(t.outcome == PASSED for t in tests):
        return f"PASS {name}"
    if not tests:
        return f"NOT RUN {name} ({f'not collected: {not_collected[0]}' if not_collected else 'no test checks it'})"
    first = next(t for t in tests if t.outcome != PASSED)
    passed = sum(t.outcome == PASSED for t in tests)
    done = f"{passed} of {len(tests)} tests passed; " if passed else ""
    return f"NOT RUN {name} ({done}{first.nodeid}: {first.reason})"


def summarise(results: list[TestResult], collection_errors: list[str] = (), collection_skips: list[str] = (),
              pytest_failed: bool = False) -> tuple[list[str], int]:
    """(one line per path of PATHS, then one for the tests outside the table when there are
    any, and a FAIL line per file that could not be collected; the exit status: 0 all PASS,
    1 a FAIL or `pytest_failed`, 2 otherwise). `collection_errors`: files that failed to
    import; `collection_skips`: "file: reason" of files skipped whole."""
    not_collected = [f"{where} failed to import" for where in collection_errors] + list(collection_skips)
    lines = [path_line(name, [t for t in results if key in t.paths], not_collected) for key, name in PATHS.items()]
    other = [t for t in results if not t.paths]
    if other:
        lines.append(path_line(OTHER, other, not_collected))
    lines += [f"FAIL collection ({where})" for where in collection_errors]
    if pytest_failed or any(line.startswith("FAIL") for line in lines):
        return lines, 1
    return lines, 0 if all(line.startswith("PASS") for line in lines) else 2


class ResultCollector:
    """A pytest plugin that keeps a TestResult per collected test."""

    def __init__(self):
        self.results: dict[str, TestResult] = {}
        self.collection_errors: list[str] = []
        self.collection_skips: list[str] = []

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors.append(report.nodeid or "tests/gpu")
        elif report.skipped:  # a whole file skipped at import (pytest.importorskip, a module-level skip)
            self.collection_skips.append(f"{report.nodeid} skipped: {_reason(report.longrepr)}")

    @pytest.hookimpl(tryfirst=True)  # before -m / -k deselect: deselected tests are reported as such
    def pytest_collection_modifyitems(self, items):
        for item in items:
            paths = tuple(p for mark in item.iter_markers("gpu_path") for p in mark.args)
            self.results[item.nodeid] = TestResult(item.nodeid, paths)

    def pytest_deselected(self, items):
        for item in items:
            if item.nodeid in self.results:
                self.results[item.nodeid].outcome, self.results[item.nodeid].reason = DESELECTED, "deselected"

    def pytest_runtest_logreport(self, report):
        result = self.results.get(report.nodeid)
        if result is None or result.outcome == FAILED:
            return
        if report.failed:
            result.outcome = FAILED
        elif report.skipped:
            result.outcome, result.reason = SKIPPED, _reason(report.longrepr)
        elif report.when == "call":
            result.outcome, result.reason = PASSED, ""


def _reason(longrepr) -> str:
    """A skip's reason from its report ((file, line, "Skipped: reason") for a skip)."""
    return longrepr[2].removeprefix("Skipped: ") if isinstance(longrepr, tuple) else str(longrepr)


def main(argv: list[str], tests: str | Path = Path(__file__).resolve().parent) -> int:
    """Run the tests under `tests` (tests/gpu) with pytest options `argv`, print the lines;
    the exit status."""
    collector = ResultCollector()
    code = pytest.main([str(tests), *argv], plugins=[collector])
    # pytest: 0 all passed, 1 some failed, 5 none collected; 2, 3, 4 = interrupted, internal or usage error
    lines, status = summarise(list(collector.results.values()), collector.collection_errors,
                              collector.collection_skips, pytest_failed=code in (2, 3, 4))
    print(f"\nGPU status ({tests}):")
    print("\n".join(lines))
    if code in (2, 3, 4):
        print(f"FAIL pytest (exit status {code}: interrupted, internal error or bad options)")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

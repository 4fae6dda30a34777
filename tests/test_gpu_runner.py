"""tests/gpu/gpu_status.py, the GPU machine's first command: the line it prints per path of the
GPU status table and its exit status, from synthetic results and from a real pytest run of a
synthetic test file; and on a machine without CUDA, NOT RUN for every path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).parent / "gpu"
sys.path.insert(0, str(GPU_DIR))  # a script of tests/gpu, imported by name as its conftest does
import gpu_status  # noqa: E402
from gpu_status import TestResult, summarise  # noqa: E402

ROWS = ["Transformer Engine layers", "THD packing", "TE context parallelism", "FP8", "FP8 param gather",
        "optimizer offload", "NCCL weight sync", "CUDA IPC weight sync", "memory release/resume",
        "MoE with expert parallelism", "MoE routing replay", "partial rollouts on SGLang", "SGLang launch flags"]


def test_paths_are_the_rows_of_the_gpu_status_table():
    assert list(gpu_status.PATHS.values()) == ROWS


def every_path_passing() -> list[TestResult]:
    return [TestResult(f"t.py::test_{key}", (key,), "passed", "") for key in gpu_status.PATHS]


def test_all_passed_is_status_0():
    lines, status = summarise(every_path_passing())
    assert lines == [f"PASS {row}" for row in ROWS] and status == 0


def test_a_failure_fails_every_path_its_test_checks_and_names_the_first_failing_test():
    results = every_path_passing() + [
        TestResult("t.py::test_thd_a", ("te_layers", "thd_packing"), "failed", ""),
        TestResult("t.py::test_thd_b", ("thd_packing",), "failed", ""),
    ]
    lines, status = summarise(results)
    assert lines[:2] == ["FAIL Transformer Engine layers (t.py::test_thd_a)", "FAIL THD packing (t.py::test_thd_a)"]
    assert lines[2:] == [f"PASS {row}" for row in ROWS[2:]]
    assert status == 1


def test_a_path_partly_run_is_not_run_with_the_first_reason():
    results = every_path_passing() + [TestResult("t.py::test_cp[2]", ("te_cp",), "skipped", "needs two GPUs"),
                                      TestResult("t.py::test_cp[4]", ("te_cp",), "skipped", "needs four GPUs")]
    lines, status = summarise(results)
    assert lines[2] == "NOT RUN TE context parallelism (1 of 3 tests passed; t.py::test_cp[2]: needs two GPUs)"
    assert status == 2


def test_without_cuda_nothing_runs_status_2():
    results = [TestResult(f"t.py::test_{key}", (key,), "skipped", "needs CUDA") for key in gpu_status.PATHS]
    lines, status = summarise(results)
    assert lines == [f"NOT RUN {row} (t.py::test_{key}: needs CUDA)" for key, row in zip(gpu_status.PATHS, ROWS)]
    assert status == 2


def test_paths_without_tests_and_files_that_did_not_import():
    results = [r for r in every_path_passing() if r.paths != ("fp8",)]
    lines, status = summarise(results)
    assert lines[3] == "NOT RUN FP8 (no test checks it)" and status == 2
    lines, status = summarise(results, collection_errors=["tests/gpu/test_fp8.py"])
    assert lines[3] == "NOT RUN FP8 (not collected: tests/gpu/test_fp8.py failed to import)"
    assert lines[-1] == "FAIL collection (tests/gpu/test_fp8.py)" and status == 1
    lines, _ = summarise(results, collection_skips=["tests/gpu/test_fp8.py skipped: no module named 'te'"])
    assert lines[3] == "NOT RUN FP8 (not collected: tests/gpu/test_fp8.py skipped: no module named 'te')"


def test_tests_outside_the_table_get_a_line_and_count():
    lines, status = summarise(every_path_passing() + [TestResult("t.py::test_disk", (), "failed", "")])
    assert lines[-1] == "FAIL other GPU tests (t.py::test_disk)" and status == 1


def test_pytest_that_could_not_run_is_status_1():
    assert summarise(every_path_passing(), pytest_failed=True)[1] == 1


SYNTHETIC = '''
import pytest

path = pytest.mark.gpu_path


@pytest.fixture
def broken():
    raise RuntimeError("no server")


@path("te_layers")
def test_layers():
    pass


@path("te_layers", "thd_packing")
def test_packed():
    assert 1 == 2


@path("fp8")
def test_fp8():
    pytest.skip("no FP8 here")


@path("fp8_param_gather")
def test_param_gather(broken):
    pass


@path("optimizer_offload")
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.skip(reason="two"))])
def test_offload(n):
    pass


@path("sglang_flags")
def test_flags():
    pass


@path("sglang_flags")
def test_flags_left_out():
    pass


def test_outside():
    pass
'''


def test_a_real_pytest_run(tmp_path):
    """gpu_status.main over a synthetic file: a pass, a failure, a skip, a fixture error, a
    skipped parameter, a deselected test (-k) and paths without tests, worked out by hand."""
    (tmp_path / "conftest.py").write_text(
        "def pytest_configure(config):\n    config.addinivalue_line('markers', 'gpu_path(*names): paths')\n")
    (tmp_path / "test_synthetic.py").write_text(textwrap.dedent(SYNTHETIC))
    run = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import gpu_status; "
                          "sys.exit(gpu_status.main(['-p', 'no:cacheprovider', '-k', 'not left_out'], sys.argv[2]))",
                          str(GPU_DIR), str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = run.stdout.split(f"GPU status ({tmp_path}):\n")[1].splitlines()
    f = "test_synthetic.py::"
    assert lines == [
        f"FAIL Transformer Engine layers ({f}test_packed)",
        f"FAIL THD packing ({f}test_packed)",
        "NOT RUN TE context parallelism (no test checks it)",
        f"NOT RUN FP8 ({f}test_fp8: no FP8 here)",
        f"FAIL FP8 param gather ({f}test_param_gather)",
        f"NOT RUN optimizer offload (1 of 2 tests passed; {f}test_offload[2]: two)",
        "NOT RUN NCCL weight sync (no test checks it)",
        "NOT RUN CUDA IPC weight sync (no test checks it)",
        "NOT RUN memory release/resume (no test checks it)",
        "NOT RUN MoE with expert parallelism (no test checks it)",
        "NOT RUN MoE routing replay (no test checks it)",
        "NOT RUN partial rollouts on SGLang (no test checks it)",
        f"NOT RUN SGLang launch flags (1 of 2 tests passed; {f}test_flags_left_out: deselected)",
        "PASS other GPU tests",
    ], run.stdout + run.stderr
    assert run.returncode == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the GPU tests would run")
def test_on_this_machine_every_path_is_not_run():
    """Every path has a test in tests/gpu, and without CUDA none runs: status 2."""
    run = subprocess.run([sys.executable, str(GPU_DIR / "gpu_status.py"), "-p", "no:cacheprovider"],
                         capture_output=True, text=True, timeout=300)
    lines = run.stdout.split("GPU status (")[1].splitlines()[1:]
    assert [line.split(" (")[0] for line in lines] == [f"NOT RUN {row}" for row in ROWS + ["other GPU tests"]]
    assert not any("no test checks it" in line for line in lines)
    assert run.returncode == 2, run.stdout[-2000:]

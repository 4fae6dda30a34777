"""The real SGLang 0.5.23 server on the CPU (`make test-sglang`, not part of `make test`).

Every test here runs against SGLang's own server processes, started the way the fleet starts
them (megarl.rollout.sglang_launch: `server_command`, `ServerProcess`, the run's key through
megarl.rollout.with_api_key), from the environment `make sglang-env` builds (.venv-sglang, or
$MEGARL_SGLANG_PYTHON). Without that environment the tests fail, naming the command that
builds it: they are the only check of megarl against the real server, so they never skip.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sglang_python() -> str:
    """The interpreter of the SGLang environment; pytest.fail (not skip) when it is missing."""
    python = os.environ.get("MEGARL_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
    if not Path(python).is_file():
        pytest.fail(f"no SGLang environment at {python}: build it with `make sglang-env` "
                    "(or point $MEGARL_SGLANG_PYTHON at a Python with SGLang 0.5.23 and megarl)")
    return python


@pytest.fixture(scope="session")
def sglang_env() -> str:
    return sglang_python()


@pytest.fixture(scope="session", autouse=True)
def tests_importable():
    # Ray workers and helper processes import the tests' modules (tiny_models) by name
    tests = str(ROOT / "tests")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
        if tests not in sys.path:
            sys.path.insert(0, tests)
        yield

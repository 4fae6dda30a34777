import os
import sys
from pathlib import Path

import pytest

# test helpers (tiny models, reward fixtures) import as top-level modules, also in worker processes
sys.path.insert(0, str(Path(__file__).resolve().parent))

# pytest-xdist workers (make test): each its own range of sandbox uids, so that a test checking
# that no sandbox process outlived its case sees only its own worker's sandboxes
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw"):
    os.environ["MEGARL_SANDBOX_UID_BASE"] = str(62000 + 1000 * int(_worker[2:]))


@pytest.fixture(scope="session")
def tiny_inputs(tmp_path_factory):
    """train_fixtures.write_tiny_run_inputs, written once for the session."""
    from train_fixtures import built_once, tiny_run_paths, write_tiny_run_inputs

    return tiny_run_paths(built_once(tmp_path_factory, "tiny-inputs", write_tiny_run_inputs))


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory, tiny_inputs):
    """The output directory of train_fixtures.tiny_reference_run, run once for the session."""
    from train_fixtures import built_once, tiny_reference_run

    return built_once(tmp_path_factory, "tiny-reference", lambda out: tiny_reference_run(tiny_inputs, out))

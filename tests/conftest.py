import os
import sys
from pathlib import Path

# test helpers (tiny models, reward fixtures) import as top-level modules, also in worker processes
sys.path.insert(0, str(Path(__file__).resolve().parent))

# pytest-xdist workers (make test): each its own range of sandbox uids, so that a test checking
# that no sandbox process outlived its case sees only its own worker's sandboxes
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw"):
    os.environ["MEGARL_SANDBOX_UID_BASE"] = str(62000 + 1000 * int(_worker[2:]))

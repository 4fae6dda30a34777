"""The `gpu_path` marker: which rows of the GPU status table a GPU test checks (gpu_status.PATHS)."""

import pytest

from gpu_status import PATHS


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_path(*names): the GPU-only paths a test checks (tests/gpu/gpu_status.py)")


def pytest_collection_modifyitems(items):
    for item in items:
        unknown = [p for mark in item.iter_markers("gpu_path") for p in mark.args if p not in PATHS]
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: gpu_path {unknown} is not a path of tests/gpu/gpu_status.py's "
                                    f"PATHS ({', '.join(PATHS)})")

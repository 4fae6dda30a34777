"""The Python tool: the model's code runs in the code rewards' bubblewrap sandbox, and the
observation is what it printed, or why it failed."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from megarl.tools.base import ToolSet
from megarl.tools.python import PythonTool

if shutil.which("bwrap") is None:  # make setup installs it (as root); CI must have it, as for test_sandbox
    if os.environ.get("CI"):
        pytest.fail("bubblewrap is not installed: `make setup` should have installed it", pytrace=False)
    pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap", allow_module_level=True)

TOOLS = ToolSet([PythonTool(wall_s=2.0, max_output_chars=40)])


def observe(code: str):
    return asyncio.run(TOOLS.run(TOOLS.parse(f"<python>{code}</python>")))


@pytest.mark.parametrize("code, text, failed", [
    ("print(37 * 48)", "1776\n", False),
    ("```python\nprint(2 ** 10)\n```", "1024\n", False),  # a fenced block, as chat models write code
    ("import socket; socket.create_connection(('127.0.0.1', 22), timeout=1); print('reached')", None, True),
    ("print('x' * 100)", "x" * 40, False),  # the output cut to max_output_chars
    ("while True: pass", "Python failed: it ran past 2 s", True),
    ("raise SystemExit(3)", "Python failed: exit code 3", True),
])
def test_the_code_runs_in_the_sandbox(code, text, failed):
    result = observe(code)
    assert result.failed == failed
    assert result.text.startswith("\n\n<output>") and result.text.endswith("</output>\n\n")
    body = result.text[len("\n\n<output>"): -len("</output>\n\n")]
    if text is not None:
        assert body == text
    else:  # no network in the sandbox: the connection fails, with its traceback for the model
        assert body.startswith("Python failed: exit code 1") and "reached" not in body


def test_a_traceback_is_what_the_model_reads():
    result = observe("1 / 0")
    assert result.failed and "ZeroDivisionError: division by zero" in result.text

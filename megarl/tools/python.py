"""The Python tool (ReTool-style training): the model's code runs in the code rewards'
sandbox, bubblewrap with the same limits (megarl.reward.sandbox), and the observation is
what it printed.

`<python> print(37 * 48) </python>` -> `<output>1776\\n</output>`. A program that fails, times
out or prints too much is a failed call whose observation says so (with the end of its
stderr: the model reads its traceback). With `sandbox_url` the code runs on a sandbox service
(`megarl sandbox serve`, as reward.code_sandbox_url) instead of this machine.
Main entry point: `PythonTool`.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from megarl.tools.base import Tool, ToolError

FENCE = re.compile(r"^```(?:python|py)?\s*\n(.*?)\n?```$", re.DOTALL)


class PythonTool(Tool):
    name = "python"
    description = "Run a Python program in a sandbox (no network, no files kept) and return what it printed."
    purpose = "run Python code"
    argument = "code"
    observation_tag = "output"

    def __init__(self, wall_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 1000,
                 sandbox_url: str | None = None):
        from megarl.reward.sandbox import Limits, LocalSandbox

        if max_output_chars < 1:
            raise ValueError(f"python tool max_output_chars={max_output_chars} must be >= 1")
        self.limits = Limits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=memory_mb)
        self.max_output_chars, self.sandbox_url = max_output_chars, sandbox_url
        self.timeout_s = wall_s + 30.0  # the sandbox's own wall limit ends the program first
        self.sandbox = None
        if sandbox_url is None:
            self.sandbox = LocalSandbox(self.limits)
            self.sandbox.check()  # bubblewrap missing: an error as the run starts, not on every call

    async def call(self, arguments: dict[str, Any]) -> str:
        code = arguments.get(self.argument)
        if not isinstance(code, str) or not code.strip():
            raise ToolError(f"give the {self.argument} as a non-empty string")
        code = code.strip()
        fenced = FENCE.match(code)
        result = await asyncio.to_thread(self._run, fenced.group(1) if fenced else code)
        output = result.stdout[: self.max_output_chars]
        if result.status != "ok":
            reason = {"timeout": f"it ran past {self.limits.wall_s:g} s", "output_limit": "it printed too much"}.get(
                result.status, f"exit code {result.exit_code}")
            tail = result.stderr[-self.max_output_chars:].strip()
            raise ToolError(f"{reason}\n{output}{tail}".rstrip())
        return output

    def _run(self, source: str):
        if self.sandbox is not None:
            return self.sandbox.run_python(source, limits=self.limits)
        from megarl.reward.sandbox_service import SandboxClient

        (result,) = SandboxClient(self.sandbox_url).run("python", source, [""], wall_s=self.limits.wall_s,
                                                        memory_mb=self.limits.memory_mb)
        return result

"""open-r1's code rewards, run in a sandbox (megarl.reward.sandbox).

`ground_truth` is open-r1's verification_info, a dict or its JSON string:
{"language": "python", "test_cases": [{"input": "...", "output": "...", "type": "stdin_stdout"}, ...]};
for the IOI-style score the cases come in subtasks with points:
{"language": "cpp", "subtasks": [{"points": 30, "test_cases": [...]}, ...]}.

- `code_score` (data_source "code"): the fraction of test cases passed; acc = all passed.
- `binary_code_score` ("code_binary"): 1.0 when every test case passes, else 0.0.
- `ioi_score` ("ioi"): the points of the subtasks whose cases all pass, over all points.
- `code_format_score` ("code_format"): 1.0 when the response is "<think>\\n...\\n</think>\\n
  <answer>\\n...```{language}...```...\\n</answer>" as open-r1's code_format_reward asks.

The program is the last fenced code block of the response in the language ("```python\\n...```"),
as open-r1 extracts it; a response without one scores 0 on every case. An output matches when
its lines, each stripped, equal the expected output's (the whole outputs stripped first).
open-r1 compares only as many lines as the shorter of the two has (Python's zip), so a
program printing the first of two expected lines passes there; here it fails.
A case passes when the program exits 0 within the limits and its output matches.

Where programs run: the local sandbox (bubblewrap on this machine), or a sandbox service
(`megarl sandbox serve`, reward.code_sandbox_url) that runs them the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import cache
from typing import Any

from megarl.reward.sandbox import LANGUAGES, OK, Limits, LocalSandbox, RunResult, run_cases
from megarl.reward.scorers import register_scorer

CODE_OPTIONS = ("code_sandbox_url", "code_wall_s", "code_memory_mb")  # the reward settings the code scorers take


def extract_code(response: str, language: str) -> str:
    """The last ```{language} fenced block of `response` ("" when there is none)."""
    blocks = re.findall(rf"```{re.escape(language)}\n(.*?)```", response, re.DOTALL)
    return blocks[-1] if blocks else ""


def output_matches(got: str, expected: str) -> bool:
    return [line.strip() for line in got.strip().split("\n")] == \
        [line.strip() for line in expected.strip().split("\n")]


def read_verification_info(ground_truth: Any, extra_info: Mapping | None, subtasks: bool = False) -> dict:
    """verification_info checked: a clear error naming the row (extra_info's index) when it is
    missing or malformed, never a silent 0."""
    row = f"row {extra_info.get('index')!r}" if isinstance(extra_info, Mapping) and "index" in extra_info else "a row"
    info = ground_truth
    if isinstance(info, (str, bytes)):
        try:
            info = json.loads(info)
        except json.JSONDecodeError as e:
            raise ValueError(f"code reward, {row}: verification_info is not valid JSON ({e})") from e
    if not isinstance(info, Mapping):
        raise ValueError(f"code reward, {row}: verification_info must be a dict (or its JSON), "
                         f"not {type(info).__name__}")
    language = info.get("language")
    if language not in LANGUAGES:
        raise ValueError(f"code reward, {row}: verification_info language {language!r}; supported: {list(LANGUAGES)}")
    groups = info.get("subtasks") if subtasks else [{"points": 1, "test_cases": info.get("test_cases")}]
    if not isinstance(groups, list) or not groups:
        raise ValueError(f"code reward, {row}: verification_info has no {'subtasks' if subtasks else 'test_cases'}")
    for g, group in enumerate(groups):
        cases = group.get("test_cases") if isinstance(group, Mapping) else None
        if not isinstance(cases, list) or not cases:
            raise ValueError(f"code reward, {row}: {'subtask ' + str(g) if subtasks else 'verification_info'} "
                             "has no test_cases (a list of {input, output})")
        if subtasks and not isinstance(group.get("points"), (int, float)):
            raise ValueError(f"code reward, {row}: subtask {g} has no points")
        for c, case in enumerate(cases):
            if not (isinstance(case, Mapping) and isinstance(case.get("input"), str)
                    and isinstance(case.get("output"), str)):
                raise ValueError(f"code reward, {row}: test case {c} needs string 'input' and 'output'")
            if case.get("type", "stdin_stdout") != "stdin_stdout":
                raise ValueError(f"code reward, {row}: test case {c} of type {case.get('type')!r}; "
                                 "only stdin_stdout is supported")
    return {"language": language, "groups": groups}


@cache
def _local_sandbox(wall_s: float, memory_mb: int) -> LocalSandbox:
    return LocalSandbox(Limits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=memory_mb))


def run_tests(language: str, source: str, cases: list[dict], *, code_sandbox_url: str | None = None,
              code_wall_s: float = 5.0, code_memory_mb: int = 512) -> list[bool]:
    """Whether each case passes (see the module docstring)."""
    if not source.strip():
        return [False] * len(cases)
    inputs = [c["input"] for c in cases]
    if code_sandbox_url:
        from megarl.reward.sandbox_service import SandboxClient

        results = SandboxClient(code_sandbox_url).run(language, source, inputs, wall_s=code_wall_s,
                                                      memory_mb=code_memory_mb)
    else:
        results = run_cases(_local_sandbox(code_wall_s, code_memory_mb), language, source, inputs)
    return [_passed(r, c["output"]) for r, c in zip(results, cases)]


def _passed(result: RunResult, expected: str) -> bool:
    return result.status == OK and output_matches(result.stdout, expected)


def _options(options: dict) -> dict:
    return {k: options[k] for k in ("code_sandbox_url", "code_wall_s", "code_memory_mb") if k in options}


@register_scorer("code", options=CODE_OPTIONS, data_sources=("code",))
def code_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None, **options) -> dict:
    info = read_verification_info(ground_truth, extra_info)
    cases = info["groups"][0]["test_cases"]
    passed = run_tests(info["language"], extract_code(solution_str, info["language"]), cases, **_options(options))
    return {"score": sum(passed) / len(cases), "acc": all(passed), "pred": f"{sum(passed)}/{len(cases)}"}


@register_scorer("code_binary", options=CODE_OPTIONS, data_sources=("code_binary",))
def binary_code_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None, **options) -> dict:
    result = code_score(solution_str, ground_truth, extra_info, **options)
    return {**result, "score": 1.0 if result["acc"] else 0.0}


@register_scorer("ioi", options=CODE_OPTIONS, data_sources=("ioi",))
def ioi_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None, **options) -> dict:
    """Subtasks with points: a subtask scores its points when all its cases pass; the score is
    the points scored over all points (each distinct input runs once)."""
    info = read_verification_info(ground_truth, extra_info, subtasks=True)
    groups = info["groups"]
    unique = list({(c["input"], c["output"]): c for g in groups for c in g["test_cases"]}.values())
    passed = run_tests(info["language"], extract_code(solution_str, info["language"]), unique, **_options(options))
    ok = {(c["input"], c["output"]) for c, p in zip(unique, passed) if p}
    scored = [g["points"] for g in groups if all((c["input"], c["output"]) in ok for c in g["test_cases"])]
    total = sum(g["points"] for g in groups)
    return {"score": sum(scored) / total if total else 0.0, "acc": len(scored) == len(groups),
            "pred": f"{sum(scored)}/{total} points"}


@register_scorer("code_format", data_sources=("code_format",))
def code_format_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None, **options) -> dict:
    """open-r1's code_format_reward: the think/answer tags around a fenced block of the language."""
    info = read_verification_info(ground_truth, extra_info)
    pattern = rf"^<think>\n.*?\n</think>\n<answer>\n.*?```{re.escape(info['language'])}.*?```.*?\n</answer>$"
    ok = re.match(pattern, solution_str, re.DOTALL | re.MULTILINE) is not None
    return {"score": 1.0 if ok else 0.0, "acc": ok, "pred": None}

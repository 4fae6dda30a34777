"""A tool with `ray: true` runs in a Ray actor of its own (megarl.runtime.service_actors.ToolActor)
and the driver calls it through RemoteTool: the model reads the same observations, failures
included, as from the tool in the driver."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import asyncio, json, sys
import ray
from megarl.runtime.local_ray import init_local_ray
from megarl.runtime.service_actors import ToolActor
from megarl.tools import RemoteTool, build_toolset

init_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
specs = {"calculator": {"ray": True}, "calc": {"class": "examples.tools.calculator:TwoNumberCalculator", "ray": True,
                                               "timeout_s": 3}}
actors = {name: ToolActor.options(num_cpus=0).remote(name, spec) for name, spec in specs.items()}
# started before the first call, as the run waits for them (wait_started): on a loaded machine a
# worker's start and imports took longer than the calculator's 5 s deadline
ray.get([a.__ray_call__.remote(lambda self: None) for a in actors.values()], timeout=120)
tools = build_toolset(specs, actors=actors)
texts = ["<calculator>37 * 48</calculator>", "<calculator>1/0</calculator>", "<calc>2 ^ 3</calc>"]
seen = [asyncio.run(tools.run(tools.parse(t))) for t in texts]
print(json.dumps({"observations": [[o.text, o.failed] for o in seen], "timeout": tools.tools["calc"].timeout_s,
                  "argument": tools.tools["calc"].argument,
                  "unbounded": RemoteTool("s", {"class": "megarl.tools.search:SearchTool"}, None).timeout_s, "pid": ray.get(actors["calc"].__ray_call__.remote(
                      lambda self: __import__("os").getpid())), "driver": __import__("os").getpid()}))
ray.shutdown()
"""


def test_a_tool_in_a_ray_actor_answers_as_in_the_driver():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["observations"] == [
        ["\n\n<result>1776</result>\n\n", False],
        ["\n\n<result>Calculator failed: division by zero</result>\n\n", True],
        ["\n\n<result>Calc failed: write two numbers and one of + - * /, e.g. 37 * 48</result>\n\n", True]]
    assert (report["timeout"], report["argument"]) == (3.0, "expression")  # the class's, and the config's deadline
    assert report["unbounded"] == 120.0  # a tool without a deadline of its own gets one across processes
    assert report["pid"] != report["driver"]  # the tool ran in the actor's process

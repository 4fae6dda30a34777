"""Tools of the multi-turn agent: the interface (megarl.tools.base), the built-ins (search,
calculator, python) and building a run's tools from its config.

A run names its tools in `agent.tools`, a mapping from the tool's name (its tag) to its
settings: `class` (an import string "package.module:Class"; not needed for a built-in),
`timeout_s` (the deadline of one call), and the rest given to the class's constructor:

    agent:
      max_turns: 3
      tools:
        calculator: {max_digits: 50}
        weather: {class: my_tools.weather:Weather, timeout_s: 5, city_list: data/cities.txt}

A tool's class is imported when the config is read, and its settings are checked against
its constructor there: a typo stops the run before anything starts. Tools run in the driver
as asyncio tasks; what needs isolation or a server is behind one (search: the retrieval
server; python: the bubblewrap sandbox or a sandbox service). `ray: true` runs a tool in a
Ray actor of its own (`num_cpus` reserved for it, default 0) where the run uses Ray: for a tool
that holds a model, a cache or CPU work the driver should not carry; the driver then calls it
through `RemoteTool`. Main entry points: `build_toolset`, `tool_problems`.
"""

from __future__ import annotations

import inspect
from typing import Any

from megarl.import_string import import_function
from megarl.tools.base import Tool, ToolError, ToolSet, check_tool_name, not_text

BUILTIN_TOOLS = {"search": "megarl.tools.search:SearchTool", "calculator": "megarl.tools.calculator:Calculator",
                 "python": "megarl.tools.python:PythonTool"}
REMOTE_CALL_S = 120.0  # the deadline of a call to a tool's Ray actor when neither the tool nor the config sets one
SPEC_KEYS = ("class", "timeout_s", "ray", "num_cpus")  # the loop's settings of a tool; the rest go to its constructor


def tool_class(name: str, spec: dict[str, Any]) -> type[Tool]:
    """The class of the tool `name` (its `class`, else the built-in of that name); ValueError."""
    path = spec.get("class", BUILTIN_TOOLS.get(name))
    if path is None:
        raise ValueError(f"agent.tools.{name}: no built-in tool has this name ({', '.join(BUILTIN_TOOLS)}); "
                         "give its class: {class: 'package.module:Class', ...}")
    if not isinstance(path, str):
        raise ValueError(f"agent.tools.{name}.class: {path!r} is not an import string 'package.module:Class'")
    try:
        cls = import_function(path, "the class", "'package.module:Class'")
    except ValueError as e:
        raise ValueError(f"agent.tools.{name}.class: {e}") from None
    if not (inspect.isclass(cls) and issubclass(cls, Tool)):
        raise ValueError(f"agent.tools.{name}.class: {path!r} is not a subclass of megarl.tools.base.Tool")
    return cls


def is_search(name: str, spec: dict[str, Any]) -> bool:
    """Whether the tool is Search-R1's search, served by the run's retrieval server."""
    from megarl.tools.search import SearchTool

    try:
        return issubclass(tool_class(name, spec), SearchTool)
    except ValueError:
        return False


def tool_problems(name: str, spec: dict[str, Any]) -> list[str]:
    """What is wrong with one entry of agent.tools, each as a sentence (none: it builds)."""
    try:
        check_tool_name(name)
        cls = tool_class(name, spec)
    except ValueError as e:
        return [str(e)]
    problems = []
    if not isinstance(spec.get("ray", False), bool):
        problems.append(f"agent.tools.{name}.ray: {spec['ray']!r} is not true or false")
    cpus = spec.get("num_cpus", 0)
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus < 0:
        problems.append(f"agent.tools.{name}.num_cpus: {cpus!r} is not a number of CPUs >= 0")
    timeout = spec.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        problems.append(f"agent.tools.{name}.timeout_s: {timeout!r} is not a number of seconds > 0")
    settings = {k: v for k, v in spec.items() if k not in SPEC_KEYS}
    if is_search(name, spec):
        if settings:
            problems.append(f"agent.tools.{name}: {sorted(settings)} are not search settings; search is set in "
                            "agent.retrieval (url or index_dir, topk, timeout_s, ...)")
        return problems
    try:
        inspect.signature(cls).bind(**settings)
    except TypeError as e:
        problems.append(f"agent.tools.{name}: {cls.__name__}{inspect.signature(cls)} cannot take {settings}: {e}")
    return problems


def build_tool(name: str, spec: dict[str, Any], searcher=None, topk: int = 3) -> Tool:
    cls = tool_class(name, spec)
    settings = {k: v for k, v in spec.items() if k not in SPEC_KEYS}
    if is_search(name, spec):
        if searcher is None:
            raise ValueError(f"agent.tools.{name} searches, but the run has no retrieval client")
        tool = cls(searcher, topk=topk)
    else:
        tool = cls(**settings)
    tool.name = name  # the config's key names the tag, whatever the class calls itself
    if spec.get("timeout_s") is not None:
        tool.timeout_s = float(spec["timeout_s"])
    return tool


class RemoteTool(Tool):
    """A tool running in a Ray actor (megarl.runtime.service_actors.ToolActor), called from the
    driver: its class's attributes, its calls sent to the actor. The actor answers every call
    with (ok, text), its failures as text, so the model reads the same as from a local tool."""

    def __init__(self, name: str, spec: dict[str, Any], actor):
        cls = tool_class(name, spec)
        for attribute in ("description", "purpose", "argument", "observation_tag", "timeout_s"):
            setattr(self, attribute, getattr(cls, attribute))
        self.name, self.actor, self._parameters = name, actor, cls.parameters
        if spec.get("timeout_s") is not None:
            self.timeout_s = float(spec["timeout_s"])
        if self.timeout_s is None:  # a call to another process always has a deadline
            self.timeout_s = REMOTE_CALL_S

    @property
    def parameters(self) -> dict:
        return self._parameters if isinstance(self._parameters, dict) else Tool.parameters.fget(self)

    async def call(self, arguments: dict[str, Any]) -> str:
        ok, text = await self.actor.call.remote(arguments)
        if not ok:
            raise ToolError(text)
        return text


def build_toolset(tools: dict[str, dict[str, Any]], call_format: str = "tags", tokenizer=None, searcher=None,
                  topk: int = 3, actors: dict | None = None) -> ToolSet:
    """The run's tools (agent.tools), each built from its settings; those in `actors` (name ->
    the Ray actor running it) called there."""
    actors = actors or {}
    return ToolSet([RemoteTool(name, spec, actors[name]) if name in actors else build_tool(name, spec, searcher, topk)
                    for name, spec in tools.items()], call_format, tokenizer)


async def call_in_actor(tool: Tool, arguments: dict[str, Any]) -> tuple[bool, str]:
    """A call as the actor makes it: (True, result) or (False, what the model should read
    after "Name failed: "), a ToolError's message or an exception's type and message."""
    try:
        result = await tool.call(arguments)
    except ToolError as e:
        return False, str(e)
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
    return (True, result) if isinstance(result, str) else (False, not_text(result))

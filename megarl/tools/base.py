"""The tool interface of the agent loop: a `Tool`, the two ways a model calls one, and the
`ToolSet` that reads a turn's action and runs the call.

A tool has a name, a description and its parameters (a JSON schema, as chat templates list
tools), and one async `call(arguments) -> str`, the observation text. It raises `ToolError`
for a failure the model should read ("division by zero"); any other exception, and a call
past `timeout_s`, become an observation too: a tool never crashes a trajectory.

How the model calls a tool (`agent.tool_format`):
- "tags" (Search-R1): `<search> query </search>`; the text between the tags fills the
  tool's one `argument`, and the observation comes back inside the tool's
  `observation_tag` (`<information>` for search). A turn with neither a call nor an
  `<answer>` gets the invalid-action message and another turn.
- "tool_call" (the chat templates of Qwen2.5/Qwen3 and others, Hermes style):
  `<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>`; the
  observation is the template's tool message (`ChatToolFrame`), and a turn without a call
  ends the trajectory: it is the model's reply.
In both an `<answer>` ends the trajectory. Main entry points: `Tool`, `ToolSet`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
RESERVED_NAMES = ("answer", "think", "tool_call", "tool_response")  # tags the loop or the templates own
CallFormat = Literal["tags", "tool_call"]


class ToolError(Exception):
    """A failure of a call that the model reads as its observation, e.g. a bad expression."""


class Tool:
    """Subclass and set the class attributes; `call` receives the arguments as a dict.

    name: the tag (`<name>...</name>`) and the function name the model calls; a run's config
        may rename it (the key of agent.tools).
    purpose, argument: Search-R1's invalid-action message says "If I want to {purpose}, I
        should put the {argument} between <name> and </name>"; `argument` is also the
        parameter a tag call fills.
    observation_tag: the tags format's observation is `\\n\\n<{observation_tag}>text</...>\\n\\n`.
    timeout_s: deadline of one call (None: the tool keeps its own deadlines, as search's
        client does, with retries).
    """

    name: str = ""
    description: str = ""
    purpose: str = "use the tool"
    argument: str = "input"
    observation_tag: str = "result"
    timeout_s: float | None = 30.0

    @property
    def parameters(self) -> dict:
        """The JSON schema of the arguments (one string parameter unless a tool says more)."""
        return {"type": "object", "properties": {self.argument: {"type": "string"}}, "required": [self.argument]}

    def schema(self) -> dict:
        """The tool as chat templates take it (`apply_chat_template(..., tools=[...])`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def call(self, arguments: dict[str, Any]) -> str:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release what the tool holds (connections); called once when the run ends."""


@dataclass(frozen=True)
class Action:
    kind: Literal["call", "answer", "invalid", "reply"]
    tool: str = ""  # with call: the tool's name
    arguments: dict | None = None  # with call
    content: str = ""  # the answer, or what was wrong with the call
    error: str = ""  # a call the loop could not read: why (the observation says it)


@dataclass(frozen=True)
class Observation:
    text: str
    tool: str
    failed: bool
    seconds: float


class ChatToolFrame:
    """The text a chat template puts around a tool's result, from the end of the assistant's
    message (its generation stopped at `</tool_call>`) to the start of the next assistant turn:
    rendered once from a conversation with placeholders, so the observation is exactly what
    the template would render (Qwen2.5: `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n`
    ... `\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`)."""

    ASSISTANT, RESULT = "MEGARL-ASSISTANT-MESSAGE", "MEGARL-TOOL-RESULT"

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("agent.tool_format=tool_call renders observations with the tokenizer's chat template, "
                             "and this tokenizer has none: use agent.tool_format=tags")
        messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": self.ASSISTANT},
                    {"role": "tool", "content": self.RESULT}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        start, middle = text.find(self.ASSISTANT), text.find(self.RESULT)
        if start < 0 or middle < start:
            raise ValueError("the tokenizer's chat template does not render a tool message after the assistant's: "
                             "use agent.tool_format=tags")
        self.before = text[start + len(self.ASSISTANT): middle]
        self.after = text[middle + len(self.RESULT):]

    def render(self, result: str) -> str:
        return self.before + result + self.after


class ToolSet:
    """The tools of a run and how the model calls them (see the module docstring)."""

    def __init__(self, tools: list[Tool], call_format: CallFormat = "tags", tokenizer=None):
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"two tools share a name: {names}")
        for name in names:
            check_tool_name(name)
        self.tools = {t.name: t for t in tools}
        self.call_format = call_format
        self.frame = ChatToolFrame(tokenizer) if call_format == "tool_call" else None

    def stop_strings(self, final: bool) -> tuple[str, ...]:
        """Where a turn's generation stops: after a call (not on the last turn) or an answer."""
        if final:
            return (ANSWER_CLOSE,)
        calls = (TOOL_CALL_CLOSE,) if self.call_format == "tool_call" else tuple(f"</{n}>" for n in self.tools)
        return calls + (ANSWER_CLOSE,)

    def parse(self, text: str) -> Action:
        """The action of one turn's text. Of the calls and the answer, the one whose closing tag
        comes first wins; its content is taken from the nearest opening tag before it (so a stray,
        unclosed opening tag earlier does not leak in)."""
        tags = [("answer", ANSWER_OPEN, ANSWER_CLOSE)]
        if self.call_format == "tool_call":
            tags.append(("call", TOOL_CALL_OPEN, TOOL_CALL_CLOSE))
        else:
            tags += [(name, f"<{name}>", f"</{name}>") for name in self.tools]
        found = []
        for kind, open_tag, close_tag in tags:
            close = text.find(close_tag)
            start = text.rfind(open_tag, 0, close) if close >= 0 else -1
            if start >= 0:
                found.append((close, kind, text[start + len(open_tag): close].strip()))
        if not found:
            return Action("reply" if self.call_format == "tool_call" else "invalid")
        _, kind, content = min(found)
        if kind == "answer":
            return Action("answer", content=content)
        if kind == "call":
            return self._parse_tool_call(content)
        if not content:  # an empty query or expression
            return Action("invalid")
        return Action("call", kind, {self.tools[kind].argument: content})

    def _parse_tool_call(self, content: str) -> Action:
        try:
            call = json.loads(content)
        except json.JSONDecodeError as e:
            return Action("call", error=f"the tool call is not JSON ({e.msg} at character {e.pos})")
        except RecursionError:  # a model's output nested thousands of levels deep
            return Action("call", error="the tool call is nested too deeply to read")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Action("call", error='a tool call is {"name": ..., "arguments": {...}}')
        name, arguments = call["name"], call.get("arguments", {})
        if isinstance(arguments, str):  # some templates and models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                pass
        if name not in self.tools:  # counted as "unknown": a name the model invents never becomes a metric
            shown = name if len(name) <= 40 else name[:40] + "..."
            return Action("call", error=f"there is no tool {shown!r}; the tools are {', '.join(self.tools)}")
        if not isinstance(arguments, dict):
            return Action("call", name, error=f"the arguments of {name} are not a JSON object")
        return Action("call", name, arguments)

    async def run(self, action: Action) -> Observation:
        """The call's observation. Failures (ToolError, any other exception, the deadline, a
        call the loop could not read) are observations with failed=True."""
        start = time.monotonic()
        tool = self.tools.get(action.tool)
        if action.error or tool is None:
            return self._observe(action.error or "no such tool", action.tool or "unknown", True, start)
        try:
            coroutine = tool.call(action.arguments or {})
            result = await (coroutine if tool.timeout_s is None else asyncio.wait_for(coroutine, tool.timeout_s))
        except asyncio.TimeoutError:
            return self._observe(f"{tool.name} failed: no result within {tool.timeout_s:g} s", tool.name, True, start)
        except ToolError as e:
            return self._observe(failure_text(tool.name, str(e)), tool.name, True, start)
        except Exception as e:  # a tool's bug is the model's observation, and counted: never a lost trajectory
            return self._observe(f"{tool.name} failed: {type(e).__name__}: {e}", tool.name, True, start)
        if not isinstance(result, str):  # a forgotten return (None), a dict: the tool's bug, never text by accident
            return self._observe(failure_text(tool.name, not_text(result)), tool.name, True, start)
        return self._observe(result, tool.name, False, start)

    def _observe(self, text: str, name: str, failed: bool, start: float) -> Observation:
        if self.frame is not None:
            rendered = self.frame.render(text)
        else:
            rendered = tagged_observation(self.tools[name].observation_tag if name in self.tools else "result", text)
        return Observation(rendered, name, failed, time.monotonic() - start)

    def invalid_message(self) -> str:
        return invalid_action_message(self.tools)

    async def aclose(self) -> None:
        for tool in self.tools.values():
            await tool.aclose()


def invalid_action_message(tools: dict[str, Tool | type[Tool]]) -> str:
    """Search-R1's invalid-action message naming every tool, by name (with search alone,
    Search-R1's own words). The tools may be classes: only their purpose and argument are read."""
    calls = " ".join(f"If I want to {t.purpose}, I should put the {t.argument} between <{n}> and </{n}>."
                     for n, t in tools.items())
    return (f"\nMy previous action is invalid. {calls} If I want to give the final answer, I should put the answer "
            "between <answer> and </answer>. Let me try again.\n")


def tagged_observation(tag: str, text: str) -> str:
    """The tags format's observation: Search-R1's `<information>` layout, blank lines around."""
    return f"\n\n<{tag}>{text}</{tag}>\n\n"


def not_text(result: object) -> str:
    """Why a tool's result that is not a str is a failed call, as the model reads it."""
    log.warning("a tool returned %s, not a str: counted as a failed call", type(result).__name__)
    return f"the tool returned {type(result).__name__}, not text"


def failure_text(name: str, message: str) -> str:
    """What the model reads of a ToolError: "Search failed: ..." (Search-R1's words for search)."""
    return f"{name.capitalize()} failed: {message}"


def check_tool_name(name: str) -> None:
    """ValueError unless `name` can be a tag and a function name of its own."""
    if not TAG_NAME.fullmatch(name) or name in RESERVED_NAMES:
        raise ValueError(f"tool name {name!r} must be a tag name (letters, digits, _ . -, not starting with a digit) "
                         f"other than {', '.join(RESERVED_NAMES)}")

"""A tool written outside megarl, as a model of one: a calculator of one operation, `a op b`.

Use it from a run's config (with this directory's parent on PYTHONPATH, or the file copied
into a package of yours):

    agent:
      max_turns: 2
      tools:
        calc: {class: "examples.tools.calculator:TwoNumberCalculator", decimals: 4}

The model then writes `<calc> 37 * 48 </calc>` and reads `<result>1776</result>`. megarl's
own calculator (agent.tools={calculator: {}}) takes whole expressions.
"""

import operator
import re

from megarl.tools.base import Tool, ToolError

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
CALL = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*([-+*/])\s*(-?\d+(?:\.\d+)?)\s*")


class TwoNumberCalculator(Tool):
    name = "calc"  # the default tag; the key in agent.tools renames it
    description = "Compute a op b for two numbers and one of + - * /."
    purpose, argument = "calculate", "expression"  # Search-R1's invalid-action message uses both
    observation_tag = "result"
    timeout_s = 2.0

    def __init__(self, decimals: int = 6):  # the settings in agent.tools.NAME, checked as the config loads
        self.decimals = decimals

    async def call(self, arguments: dict) -> str:
        match = CALL.fullmatch(arguments.get(self.argument, ""))
        if match is None:
            raise ToolError("write two numbers and one of + - * /, e.g. 37 * 48")  # the model reads this
        a, op, b = float(match.group(1)), match.group(2), float(match.group(3))
        if op == "/" and b == 0:
            raise ToolError("division by zero")
        value = round(OPERATIONS[op](a, b), self.decimals)
        return str(int(value)) if value == int(value) else str(value)

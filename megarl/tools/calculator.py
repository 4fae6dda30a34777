"""The calculator tool: exact arithmetic on what the model writes, with no `eval`.

`<calculator> 37 * 48 </calculator>` -> `<result>1776</result>`. The expression is parsed by
Python's `ast` and only numbers, + - * / // % ** (also written ^), unary signs and
parentheses are evaluated, over fractions, so 0.1 + 0.2 is 0.3 and 1/3*3 is 1. Bounds keep a
call cheap whatever the model writes: the expression's length, the size of an exponent and
the digits of every intermediate value. Main entry points: `evaluate`, `Calculator`.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction
from typing import Any

from megarl.tools.base import Tool, ToolError

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
SPELLINGS = {"×": "*", "·": "*", "÷": "/", "^": "**", "−": "-"}  # how models write operators


def evaluate(expression: str, max_length: int = 200, max_exponent: int = 64, max_digits: int = 100) -> Fraction:
    """The exact value of an arithmetic expression; ToolError saying what is wrong otherwise."""
    text = expression.strip()
    for spelled, op in SPELLINGS.items():
        text = text.replace(spelled, op)
    if not text:
        raise ToolError("the expression is empty")
    if len(text) > max_length:
        raise ToolError(f"the expression is longer than {max_length} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot read {expression.strip()!r} as arithmetic") from None
    max_bits = math.ceil(max_digits * math.log2(10))  # bits, not str(): no conversion of a huge number

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
            return SIGNS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ToolError("division by zero")
            if isinstance(node.op, ast.Pow):
                if right.denominator != 1:
                    raise ToolError("only whole-number powers")
                if abs(right) > max_exponent:
                    raise ToolError(f"an exponent above {max_exponent}")
                if left == 0 and right < 0:
                    raise ToolError("division by zero")
            out = Fraction(OPERATORS[type(node.op)](left, right))
            if max(abs(out.numerator).bit_length(), out.denominator.bit_length()) > max_bits:
                raise ToolError(f"a number of more than {max_digits} digits")
            return out
        raise ToolError(f"{ast.unparse(node)!r} is not arithmetic (numbers, + - * / // % ** and parentheses)")

    return value(tree.body)


def format_number(x: Fraction, significant: int = 12) -> str:
    """An integer as itself; another number as a decimal of `significant` digits, trailing zeros dropped."""
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.{significant}g}"


class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses."
    purpose = "calculate"
    argument = "expression"
    observation_tag = "result"
    timeout_s = 5.0

    def __init__(self, max_length: int = 200, max_exponent: int = 64, max_digits: int = 100):
        if min(max_length, max_exponent, max_digits) < 1:
            raise ValueError(f"calculator limits must be >= 1, got max_length={max_length}, "
                             f"max_exponent={max_exponent}, max_digits={max_digits}")
        self.limits = {"max_length": max_length, "max_exponent": max_exponent, "max_digits": max_digits}

    async def call(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get(self.argument)
        if not isinstance(expression, str):
            raise ToolError(f"give the {self.argument} as a string")
        return format_number(evaluate(expression, **self.limits))

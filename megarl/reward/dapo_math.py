"""DAPO math reward: the response ends with a line "Answer: <answer>"; the answer is
compared with the ground truth after Minerva-style normalisation (the normalisation of
Lewkowycz et al. 2022, used by the DAPO recipe). +1 when equal, −1 otherwise.

Main entry point: `dapo_math_score`.
"""

from __future__ import annotations

import re
from typing import Any

INVALID_PREDICTION = "[INVALID]"
# The DAPO prompt asks for the answer on the last line; looking only at the tail keeps
# scoring O(1) in the response length and ignores "Answer:" mentioned while reasoning.
RESPONSE_TAIL_CHARS = 300

_ANSWER_LINE = re.compile(r"answer\s*:([^\n]*)", re.IGNORECASE)

# Words that only carry units or the noun being counted ("5 dollars", "12 ways"). Matched
# as whole words (letters on neither side) and with an optional plural, so "cm" inside
# "\text{cm}" or "5cm" goes but "cent" inside "percent" stays.
_UNIT_WORDS = (
    "square", "way", "integer", "dollar", "mph", "inch", "inches", "ft", "hour", "km",
    "unit", "point", "foot", "feet", "minute", "digit", "cent", "degree", "cm", "gm",
    "pound", "meter", "meal", "edge", "student", "multiple",
)
_UNIT_WORD = re.compile(r"(?<![A-Za-z\\])(?:" + "|".join(_UNIT_WORDS) + r")s?(?![A-Za-z])")
# "\text{ cm}^2" is left as "\text{}^2" once the unit is gone: the exponent belongs to it.
_EMPTY_UNIT_POWER = re.compile(r"\\(?:text|mathrm|mbox)\{\}\^\{?\d\}?")
_DROPPED_LATEX = (
    "^\\circ", "^{\\circ}", "\\!", "\\,", "\\;", "\\:", "{,}", "\\ldots", "\\dots", '"',
)
# Wrappers whose content is the answer: \boxed{12} → 12, \text{yes} → yes.
_UNWRAPPED_COMMANDS = ("boxed", "fbox", "text", "textbf", "mathrm", "mbox", "overline")
_FIRST_DOLLAR_PAIR = re.compile(r"\$(.*?)\$")
_FRAC_ARGUMENT = r"(\{[^{}]*\}|[^{}\\])"
_SHORTHAND_FRAC = re.compile(r"\\[dt]?frac" + _FRAC_ARGUMENT + _FRAC_ARGUMENT)
_SHORTHAND_SQRT = re.compile(r"\\sqrt([^{\[\\])")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+")


def extract_prediction(response: str) -> str:
    """Text after the last "Answer:" (any case) in the response tail, to the end of its
    line, stripped; INVALID_PREDICTION when there is none."""
    matches = _ANSWER_LINE.findall(response[-RESPONSE_TAIL_CHARS:])
    return matches[-1].strip() if matches else INVALID_PREDICTION


def unwrap_command(text: str, command: str) -> str:
    r"""Replace every \command{content} with content, matching nested braces
    (\boxed{\frac{1}{2}} → \frac{1}{2}). An unbalanced group is left as it is."""
    marker = "\\" + command + "{"
    start = text.find(marker)
    while start >= 0:
        depth, end = 1, start + len(marker)
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        if depth:
            return text
        text = text[:start] + text[start + len(marker):end - 1] + text[end:]
        start = text.find(marker, start)
    return text


def _brace(argument: str) -> str:
    return argument if argument.startswith("{") else "{" + argument + "}"


def normalize_final_answer(answer: str) -> str:
    r"""Minerva-style canonical form of a final answer, applied to both prediction and
    ground truth: "x = \boxed{1,000} \text{ dollars}." → "1000"."""
    answer = answer.split("=")[-1]
    answer = answer.replace("\\$", "")
    # "the total is $42$ dollars": the math between the first pair of dollars is the answer
    dollar_pair = _FIRST_DOLLAR_PAIR.search(answer)
    if dollar_pair:
        answer = dollar_pair.group(1)
    answer = _UNIT_WORD.sub("", answer.replace("\\ ", " "))
    answer = "".join(answer.split())
    answer = _EMPTY_UNIT_POWER.sub("", answer)
    for latex in _DROPPED_LATEX:
        answer = answer.replace(latex, "")
    for command in _UNWRAPPED_COMMANDS:
        answer = unwrap_command(answer, command)
    answer = _SHORTHAND_FRAC.sub(lambda m: "\\frac" + _brace(m.group(1)) + _brace(m.group(2)), answer)
    answer = _SHORTHAND_SQRT.sub(r"\\sqrt{\1}", answer)
    answer = answer.replace("$", "").rstrip(".")
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer


def dapo_math_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """+1.0 when the normalised "Answer:" line equals the normalised ground truth, −1.0
    otherwise (also when the response has no "Answer:" line). pred is the normalised
    prediction or INVALID_PREDICTION."""
    prediction = extract_prediction(solution_str)
    if prediction == INVALID_PREDICTION:
        return {"score": -1.0, "acc": False, "pred": prediction}
    prediction = normalize_final_answer(prediction)
    correct = prediction == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": prediction}

"""DAPO math reward: the response ends with a line "Answer: <answer>"; the answer and the
ground truth are normalised and compared as strings, +1 when equal, −1 otherwise.

Main entry point: `dapo_math_score`.

Two normalisations, chosen by reward.dapo_math_normalization:
- "verl" (the default) gives, answer for answer, what verl's `math_dapo` reward gives: the
  reward DAPO's published numbers were trained and evaluated with. It is the Minerva
  normalisation (Lewkowycz et al. 2022) as lm-eval-harness writes it, quirks included: a
  trailing period counts ("628." ≠ "628"), every comma of a number-like answer goes ("3, 4",
  "34" and "3 \\text{ and } 4" are all "34"), and unit words are deleted wherever they occur
  ("percents" → "per").
- "lenient" is megarl's own normalisation: unit words only as whole words, nested braces
  unwrapped, "\\dfrac" = "\\frac", a sentence's final period dropped, commas removed only from
  thousands groups (a list stays a list). It accepts answers the reference rejects for their
  form ("628.", "\\dfrac{3}{4}" against "\\frac{3}{4}"), so its scores are not DAPO's.

Both read the answer the same way: the text after the last "Answer:" (any case; the answer may
start on the next line; an empty "Answer:" line is passed over) in the last 300 characters.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

from megarl.reward.scorers import register_scorer

INVALID_PREDICTION = "[INVALID]"
# The DAPO prompt asks for the answer on the last line; looking only at the tail keeps
# scoring O(1) in the response length and ignores "Answer:" mentioned while reasoning.
RESPONSE_TAIL_CHARS = 300

# White space after the colon may span lines, and the answer needs one character at least, so
# "Answer:\n42" reads 42 and a last, empty "Answer:" is no match (an earlier one counts).
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

DapoMathNormalization = Literal["verl", "lenient"]


def extract_prediction(response: str) -> str:
    """Text after the last "Answer:" (any case) in the response tail, from its first
    non-white-space character to the end of that line, as written (trailing white space
    kept: the normalisation decides); INVALID_PREDICTION when there is none."""
    matches = _ANSWER_LINE.findall(response[-RESPONSE_TAIL_CHARS:])
    return matches[-1] if matches else INVALID_PREDICTION


# ---- "verl": verl's math_dapo normalisation --------------------------------------------------
# Every step below runs over the whole string, in this order; the order is part of the
# behaviour ("\text{and}" is only found once the spaces are gone, "\text{}^2" before "\text{}").
_VERL_REPLACEMENTS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_VERL_DELETIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
# (pattern, replacement) in order. "." stops at a line end, as in the reference: a multi-line
# ground truth is treated line by line by the first five.
_VERL_REWRITES = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # the first $…$ pair is the answer
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),  # up to the first closing brace, not the matching one
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),  # up to the last closing brace
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 → \frac{1}{2} (and \dfrac12 → \dfrac{1}{2})
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),
)


def normalize_answer_verl(answer: str) -> str:
    r"""verl's math_dapo normalisation: "x = \boxed{1,000} dollars" → "1000", "628." → "628."."""
    answer = answer.split("=")[-1]
    for old, new in _VERL_REPLACEMENTS:
        answer = answer.replace(old, new)
    for text in _VERL_DELETIONS:
        answer = answer.replace(text, "")
    for pattern, replacement in _VERL_REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():  # str.isdigit: "3,4" → "34", and "²" counts as a digit
        answer = answer.replace(",", "")
    return answer.strip()


# ---- "lenient": megarl's normalisation --------------------------------------------------------
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
# "3 \text{ and } 4" is the list "3,4"
_TEXT_AND = re.compile(r",?\\(?:text|mbox)\{and\}")
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


def normalize_answer_lenient(answer: str) -> str:
    r"""megarl's canonical form of a final answer: "x = \boxed{1,000} \text{ dollars}." → "1000"."""
    answer = answer.split("=")[-1]
    answer = answer.replace("\\$", "")
    # "the total is $42$ dollars": the math between the first pair of dollars is the answer
    dollar_pair = _FIRST_DOLLAR_PAIR.search(answer)
    if dollar_pair:
        answer = dollar_pair.group(1)
    answer = _UNIT_WORD.sub("", answer.replace("\\ ", " "))
    answer = "".join(answer.split())
    answer = _EMPTY_UNIT_POWER.sub("", answer)
    answer = _TEXT_AND.sub(",", answer)
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


# One entry per name of DapoMathNormalization (tests/test_reward_dapo_math.py holds them equal).
NORMALIZERS: dict[str, Callable[[str], str]] = {"verl": normalize_answer_verl, "lenient": normalize_answer_lenient}


@register_scorer("dapo_math", options=("dapo_math_normalization",), last_chars=RESPONSE_TAIL_CHARS,
                 data_sources=("math_dapo", "math"), prefixes=("aime",))
def dapo_math_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    dapo_math_normalization: DapoMathNormalization = "verl",
) -> dict:
    """+1.0 when the normalised "Answer:" line equals the normalised ground truth, −1.0
    otherwise (also when the response has no "Answer:" line). pred is the normalised
    prediction, or INVALID_PREDICTION when there is none."""
    normalize = NORMALIZERS[dapo_math_normalization]
    prediction = extract_prediction(solution_str)
    if prediction == INVALID_PREDICTION:
        return {"score": -1.0, "acc": False, "pred": prediction}
    prediction = normalize(prediction)
    correct = prediction == normalize(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": prediction}

r"""math-verify accuracy with open-r1 semantics: symbolic equivalence of the response's
final LaTeX answer with the gold answer.

Main entry point: `math_verify_accuracy`.

open-r1's accuracy_reward (src/open_r1/rewards.py) parses the gold as it is, with
math-verify's default extraction, and skips the sample (None) when nothing parses. That is the
default here too (reward.math_verify_gold=open_r1), quirks included: math-verify alone reads a
bare "2\pi" as 2 and "(-\infty, 2]" as 2, and finds nothing in "\sqrt{2}".

reward.math_verify_gold=formula is megarl's reading, for data sets that store bare answers: a
gold that is a bare formula (no $, \(, \[ or \boxed) is read inside $…$, so whole; a gold that
reads as text ("Paris", "no math here") is not wrapped, so it is not taken for a product of
symbols; a gold that yields only its raw text counts as not parsing.

math-verify guards parse/verify with its own SIGALRM timers, which raise outside the
main thread and would fight megarl's own guard (megarl.reward.timeout); both are turned
off here (parsing_timeout=None, timeout_seconds=None) and every reward call runs under
megarl's timeout instead.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from functools import cache
from typing import Any, Literal

# How the gold answer is read: as open-r1 reads it, or megarl's bare-formula reading.
MathVerifyGold = Literal["open_r1", "formula"]

_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
# Commands whose argument is words even inside a formula ("3 \text{ and } 4"), then any command.
_TEXT_ARGUMENT = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mbox|operatorname)\s*\{[^{}]*\}")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
# Two letters in a row, in any script: a formula names its variables with one letter each.
_WORD = re.compile(r"[^\W\d_]{2,}")


def _drop_disabled_timeout_notice(record: logging.LogRecord) -> bool:
    # math-verify warns once per process that its timeout is off; here that is deliberate
    return not record.getMessage().startswith("Timeout is disabled")


@cache
def _math_verify() -> tuple[Callable, Callable, list]:
    """(parse, verify, extraction config for responses), imported on first use:
    math-verify pulls in sympy (~0.5 s), which routes that never need it should not pay for."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_drop_disabled_timeout_notice)
    # LaTeX only, \boxed first, units stripped, and nothing extracted from text without an
    # anchor (a boxed answer or "final answer is"), so a number mentioned while
    # reasoning is never taken for the answer. Equations ("x = 5" → 5) are handled by the
    # parser itself in math-verify >= 0.7 (NormalizationConfig.equations is deprecated).
    normalization = NormalizationConfig(
        nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True
    )
    response_config = [
        LatexExtractionConfig(
            normalization_config=normalization, boxed_match_priority=0, try_extract_without_anchor=False
        )
    ]
    return parse, verify, response_config


def is_text(gold: str) -> bool:
    r"""Whether a gold answer reads as text rather than as a formula: it holds a word of two
    or more letters outside LaTeX command names and the arguments of text commands.

    Text: "Paris", "no math here", "The answer is 5", "Zürich", also "xy" (a product of two
    variables, rare as an answer, is read as a word). Formulas: "2\pi", "x^2+7x+10",
    "(-\infty, 2]", "3 \text{ and } 4".
    """
    formula = _LATEX_COMMAND.sub(" ", _TEXT_ARGUMENT.sub(" ", gold))
    return _WORD.search(formula) is not None


def gold_as_latex(ground_truth: Any) -> str:
    r"""The gold answer as the text math-verify parses: as it is when it has a math delimiter
    ($…$, \(…\), \[…\], \boxed, as open-r1's full solutions have) or reads as text;
    a bare formula ("2\pi") inside $…$, so that math-verify reads it whole.
    """
    gold = str(ground_truth)
    if any(delimiter in gold for delimiter in _MATH_DELIMITERS) or is_text(gold):
        return gold
    return f"${gold}$"


def math_verify_accuracy(response: str, ground_truth: Any, gold_reading: MathVerifyGold = "open_r1") -> float | None:
    """1.0 when the response's answer is equivalent to the gold answer, else 0.0; None
    (skip this component) when the gold answer does not parse to math (a broken label, or a
    text answer such as "Paris"), as open-r1 skips it: a reward of 0 would punish the policy
    for the label, a reward of 1 would pay it for anything. `gold_reading`: see the module
    docstring (reward.math_verify_gold)."""
    parse, verify, response_config = _math_verify()
    if gold_reading == "open_r1":
        gold = parse(str(ground_truth), extraction_mode="first_match", parsing_timeout=None)
    else:  # no_fallback: a gold that yields only its raw text is unparseable, not a string to match
        gold = parse(gold_as_latex(ground_truth), extraction_mode="first_match", fallback_mode="no_fallback",
                     parsing_timeout=None)
    if not gold:
        return None
    answer = parse(
        response,
        extraction_config=response_config,
        extraction_mode="first_match",
        parsing_timeout=None,
    )
    return float(verify(gold, answer, timeout_seconds=None))


@cache
def _latex_only() -> list:
    from math_verify import LatexExtractionConfig

    return [LatexExtractionConfig()]


def open_r1_length_correct(response: str, ground_truth: Any) -> bool | None:
    """Whether the response is correct as open-r1's len_reward and cosine_scaled_reward judge it
    for themselves: the gold parsed with LaTeX extraction only (so a bare "5" does not parse,
    "$5$" and "\\boxed{5}" do), None when it does not parse; then verify(answer, gold)."""
    parse, verify, response_config = _math_verify()
    gold = parse(str(ground_truth), extraction_mode="first_match", extraction_config=_latex_only(),
                 parsing_timeout=None)
    if not gold:
        return None
    answer = parse(response, extraction_config=response_config, extraction_mode="first_match", parsing_timeout=None)
    return bool(verify(answer, gold, timeout_seconds=None))

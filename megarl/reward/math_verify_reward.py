"""math-verify accuracy with open-r1 semantics: symbolic equivalence of the response's
final LaTeX answer with the gold answer.

Main entry point: `math_verify_accuracy`.

math-verify guards parse/verify with its own SIGALRM timers, which raise outside the
main thread and would fight megarl's own guard (megarl.reward.timeout); both are turned
off here (parsing_timeout=None, timeout_seconds=None) and every reward call runs under
megarl's timeout instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from typing import Any

_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


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


def gold_as_latex(ground_truth: Any) -> str:
    """The gold answer as text math-verify can anchor on.

    open-r1's golds are full solutions with $…$ or \\boxed; math data sets (DAPO-Math,
    MATH) store the bare answer, which math-verify does not read as LaTeX without
    delimiters ("2\\pi" would parse as 2, "\\sqrt{2}" as nothing), so a gold without any
    delimiter is taken to be one formula and wrapped in $…$.
    """
    gold = str(ground_truth)
    if any(delimiter in gold for delimiter in _MATH_DELIMITERS):
        return gold
    return f"${gold}$"


def math_verify_accuracy(response: str, ground_truth: Any) -> float | None:
    """1.0 when the response's answer is equivalent to the gold answer, else 0.0; None
    (skip this component) when the gold answer itself does not parse to math, since a
    reward of 0 would then punish the policy for a broken label."""
    parse, verify, response_config = _math_verify()
    # no_fallback: a gold that yields only its raw text is unparseable, not a string to match
    gold = parse(
        gold_as_latex(ground_truth), extraction_mode="first_match", fallback_mode="no_fallback", parsing_timeout=None
    )
    if not gold:
        return None
    answer = parse(
        response,
        extraction_config=response_config,
        extraction_mode="first_match",
        parsing_timeout=None,
    )
    return float(verify(gold, answer, timeout_seconds=None))

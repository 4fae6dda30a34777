"""DAPO math reward: the "Answer:" line in the response tail, Minerva-style
normalisation, ±1 scores."""

import time

import pytest

from megarl.reward.dapo_math import (
    INVALID_PREDICTION,
    RESPONSE_TAIL_CHARS,
    dapo_math_score,
    extract_prediction,
    normalize_final_answer,
    unwrap_command,
)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Reasoning...\nAnswer: 42", "42"),
        ("answer : 7\nthat is all", "7"),  # any case, space before the colon, ends at the line
        ("ANSWER:3", "3"),
        ("Answer: 1\nAnswer: 2", "2"),  # the last one
        ("Final Answer: $\\frac{1}{2}$  ", "$\\frac{1}{2}$"),
        ("The answer is 42", INVALID_PREDICTION),  # no colon
        ("Answer: 5" + "." * RESPONSE_TAIL_CHARS, INVALID_PREDICTION),  # outside the last 300 characters
        ("Answer: 9" + "x" * (RESPONSE_TAIL_CHARS - 9), "9" + "x" * (RESPONSE_TAIL_CHARS - 9)),  # just inside
        ("", INVALID_PREDICTION),
    ],
)
def test_extract_prediction(response, expected):
    assert extract_prediction(response) == expected


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("42", "42"),
        ("x = 5", "5"),  # after the last '='
        ("a = b = 7", "7"),
        ("$\\boxed{42}$", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces kept
        ("\\frac12", "\\frac{1}{2}"),
        ("\\dfrac{3}{4}", "\\frac{3}{4}"),
        ("\\frac1{12}", "\\frac{1}{12}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}"),
        ("1,000", "1000"),
        ("1,000,000", "1000000"),
        ("1{,}000", "1000"),
        ("1,2", "1,2"),  # not a thousands group: a list stays a list
        ("5 \\text{ cm}", "5"),
        ("5 \\text{ cm}^2", "5"),
        ("12 dollars", "12"),
        ("\\$12", "12"),
        ("3 ways", "3"),
        ("7 square units", "7"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("5cm", "5"),
        ("50\\%", "50\\%"),  # percent is not a unit here
        ("5 percent", "5percent"),  # 'cent' only as a whole word
        ("\\textbf{17}", "17"),
        ("0.\\overline{3}", "0.3"),
        ("10\\!000", "10000"),
        ("4 2", "42"),  # white space is dropped
        ("42.", "42"),  # a sentence's final period
        ("the total is $42$ dollars", "42"),  # the first $…$ pair
        ("\\text{(A)}", "(A)"),
        ("", ""),
    ],
)
def test_normalize_final_answer(answer, expected):
    assert normalize_final_answer(answer) == expected


@pytest.mark.parametrize(
    "text, command, expected",
    [
        ("\\boxed{a{b}c}d", "boxed", "a{b}cd"),
        ("\\text{x}+\\text{y}", "text", "x+y"),
        ("\\boxed{unbalanced", "boxed", "\\boxed{unbalanced"),
        ("\\textbf{x}", "text", "\\textbf{x}"),  # \text{ does not match \textbf{
    ],
)
def test_unwrap_command(text, command, expected):
    assert unwrap_command(text, command) == expected


@pytest.mark.parametrize(
    "response, ground_truth, expected_score, expected_pred",
    [
        ("Thinking.\nAnswer: 42", "42", 1.0, "42"),
        ("Answer: 41", "42", -1.0, "41"),
        ("Answer: $\\boxed{42}$", "42", 1.0, "42"),
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
        ("Answer: 1,000", "1000", 1.0, "1000"),
        ("Answer: x = 5", "5", 1.0, "5"),
        ("Answer: 5 \\text{ cm}", "5", 1.0, "5"),
        ("Answer: \\sqrt2", "\\sqrt{2}", 1.0, "\\sqrt{2}"),
        ("Answer: 42", 42, 1.0, "42"),  # an integer ground truth
        ("Answer: 0.5", "\\frac{1}{2}", -1.0, "0.5"),  # string comparison, not math equivalence
        ("The answer is 42", "42", -1.0, INVALID_PREDICTION),
        ("", "42", -1.0, INVALID_PREDICTION),
        ("Answer: 42 ✓", "42", -1.0, "42✓"),
    ],
)
def test_dapo_math_score(response, ground_truth, expected_score, expected_pred):
    result = dapo_math_score(response, ground_truth)
    assert result == {"score": expected_score, "acc": expected_score > 0, "pred": expected_pred}


def test_one_megabyte_response_scores_fast():
    response = "Let me think. " * 75_000 + "\nAnswer: 1,000"
    started = time.perf_counter()
    assert dapo_math_score(response, "1000")["score"] == 1.0
    assert time.perf_counter() - started < 0.1

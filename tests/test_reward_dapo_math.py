r"""DAPO math reward: the "Answer:" line in the response tail, the two normalisations
("verl", the default, is verl's math_dapo answer for answer; "lenient" is megarl's), ±1 scores.

The differential tables hold the reference's answers worked out by hand from its steps (the
answer after "Answer\s*:\s*" up to the line end; "=" split, literal replacements, unit
deletions, $…$ / \text / \boxed / shorthand-frac rewrites, commas of digit strings dropped,
strip), not what megarl prints."""

import time
import typing

import pytest

from megarl.reward.dapo_math import (
    INVALID_PREDICTION,
    NORMALIZERS,
    RESPONSE_TAIL_CHARS,
    DapoMathNormalization,
    dapo_math_score,
    extract_prediction,
    normalize_answer_lenient,
    normalize_answer_verl,
    unwrap_command,
)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Reasoning...\nAnswer: 42", "42"),
        ("answer : 7\nthat is all", "7"),  # any case, space before the colon, ends at the line
        ("ANSWER:3", "3"),
        ("Answer: 1\nAnswer: 2", "2"),  # the last one
        ("Final Answer: $\\frac{1}{2}$  ", "$\\frac{1}{2}$  "),  # trailing white space kept: normalising decides
        ("Answer:\n628", "628"),  # the answer on the next line
        ("Answer:  \n\n  628\nmore", "628"),  # white space after the colon spans lines
        ("Answer: 628\nAnswer:", "628"),  # a last, empty Answer: line is passed over
        ("Answer: 628\nAnswer:\n", "628"),
        ("Answer: 628\nAnswer: ", " "),  # one character is enough: the space is the answer
        ("The answer is 42", INVALID_PREDICTION),  # no colon
        ("Answer:", INVALID_PREDICTION),
        ("Answer: 5" + "." * RESPONSE_TAIL_CHARS, INVALID_PREDICTION),  # outside the last 300 characters
        ("Answer: 9" + "x" * (RESPONSE_TAIL_CHARS - 9), "9" + "x" * (RESPONSE_TAIL_CHARS - 9)),  # just inside
        ("", INVALID_PREDICTION),
    ],
)
def test_extract_prediction(response, expected):
    assert extract_prediction(response) == expected


# verl's math_dapo normalisation, each worked out step by step.
@pytest.mark.parametrize(
    "answer, expected",
    [
        ("42", "42"),
        ("628.", "628."),  # a trailing period stays: no step removes it
        ("x = 5", "5"),  # after the last '=', spaces gone
        ("a = b = 7", "7"),
        ("3, 4", "34"),  # "3,4" is digits once the commas go, so they go
        ("3 \\text{ and } 4", "34"),  # spaces go, "\text{and}" becomes ",", then as above
        ("1,000", "1000"),
        ("1,2", "12"),  # any commas, not only thousands groups
        ("(1, 2)", "(1,2)"),  # not digits only: the commas stay
        ("$\\boxed{42}$", "42"),  # $…$ kept, \boxed{…} unwrapped, $ removed
        ("the total is $42$ dollars", "42"),  # "dollars" deleted, then the first $…$ pair
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # \boxed{ to the last }
        ("\\text{(A)}", "(A)"),
        ("\\text{a}\\text{b}", "ab"),  # each \text{ to its first }
        ("\\frac12", "\\frac{1}{2}"),
        ("\\frac1{12}", "\\frac{1}{{}12}"),  # the shorthand rule takes the next character, even a brace
        ("\\dfrac{3}{4}", "\\dfrac{3}{4}"),  # \dfrac is not \frac
        ("\\dfrac12", "\\dfrac{1}{2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("5 \\text{ cm}", "5"),  # "5\text{cm}" → "cm" deleted → "\text{}" deleted
        ("5 \\text{ cm}^2", "5"),  # … → "\text{}^2" deleted
        ("5 \\mbox{ m}", "5"),  # mbox → text, "\text{m}" → "\text{}", deleted
        ("10 students", "10"),
        ("50 percents", "50per"),  # "cents" is deleted wherever it occurs
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("10{,}000", "10000"),
        ("\\$12", "12"),
        ("a 5", "5"),  # "a " is deleted (an article)
        ("banana 5", "banan5"),  # … wherever it occurs
        ("an apple", "apple"),
        ("\\overline{3}", "3"),
        ("0.\\overline{3}", "0.3"),
        ("12\\text{th}", "12th"),  # only \mathrm{th} is deleted
        ("12\\mathrm{th}", "12"),
        ("42 ✓", "42✓"),
        ("  7\t", "7"),
        (" ", ""),
        ("", ""),
    ],
)
def test_normalize_answer_verl(answer, expected):
    assert normalize_answer_verl(answer) == expected


# megarl's lenient normalisation.
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
        ("3 \\text{ and } 4", "3,4"),  # a list written with "and"
        ("3, 4", "3,4"),
        ("628.", "628"),
        ("", ""),
    ],
)
def test_normalize_answer_lenient(answer, expected):
    assert normalize_answer_lenient(answer) == expected


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


# Whole responses, both normalisations; the verl column is the reference's answer.
@pytest.mark.parametrize(
    "response, ground_truth, verl, lenient",
    [
        # the examples of issue 17
        ("Thinking.\nAnswer: 628.", "628", (-1.0, "628."), (1.0, "628")),
        ("Thinking.\nAnswer:\n628", "628", (1.0, "628"), (1.0, "628")),
        ("Answer: 628\nAnswer:", "628", (1.0, "628"), (1.0, "628")),
        ("Answer: 3, 4", "3 \\text{ and } 4", (1.0, "34"), (1.0, "3,4")),
        # more
        ("Answer: 628\nAnswer: ", "628", (-1.0, ""), (-1.0, "")),
        ("Answer: 34", "3 \\text{ and } 4", (1.0, "34"), (-1.0, "34")),
        ("Answer: 1,2", "12", (1.0, "12"), (-1.0, "1,2")),
        ("Answer: \\dfrac{3}{4}", "\\frac{3}{4}", (-1.0, "\\dfrac{3}{4}"), (1.0, "\\frac{3}{4}")),
        ("Answer: 42", "42", (1.0, "42"), (1.0, "42")),
        ("Answer: 41", "42", (-1.0, "41"), (-1.0, "41")),
        ("Answer: $\\boxed{42}$", "42", (1.0, "42"), (1.0, "42")),
        ("Answer: \\frac12", "\\frac{1}{2}", (1.0, "\\frac{1}{2}"), (1.0, "\\frac{1}{2}")),
        ("Answer: 1,000", "1000", (1.0, "1000"), (1.0, "1000")),
        ("Answer: x = 5", "5", (1.0, "5"), (1.0, "5")),
        ("Answer: 5 \\text{ cm}", "5", (1.0, "5"), (1.0, "5")),
        ("Answer: \\sqrt2", "\\sqrt{2}", (1.0, "\\sqrt{2}"), (1.0, "\\sqrt{2}")),
        ("Answer: 42", 42, (1.0, "42"), (1.0, "42")),  # an integer ground truth
        ("Answer: 0.5", "\\frac{1}{2}", (-1.0, "0.5"), (-1.0, "0.5")),  # strings, not math equivalence
        ("Answer: 42 ✓", "42", (-1.0, "42✓"), (-1.0, "42✓")),
        ("The answer is 42", "42", (-1.0, INVALID_PREDICTION), (-1.0, INVALID_PREDICTION)),
        ("", "42", (-1.0, INVALID_PREDICTION), (-1.0, INVALID_PREDICTION)),
    ],
)
def test_dapo_math_score(response, ground_truth, verl, lenient):
    for normalization, (score, pred) in (("verl", verl), ("lenient", lenient)):
        result = dapo_math_score(response, ground_truth, dapo_math_normalization=normalization)
        assert result == {"score": score, "acc": score > 0, "pred": pred}, normalization


def test_the_default_is_verl():
    assert dapo_math_score("Answer: 628.", "628")["score"] == -1.0


def test_every_normalization_name_has_a_normalizer():
    assert set(NORMALIZERS) == set(typing.get_args(DapoMathNormalization))


def test_one_megabyte_response_scores_fast():
    response = "Let me think. " * 75_000 + "\nAnswer: 1,000"
    started = time.perf_counter()
    assert dapo_math_score(response, "1000")["score"] == 1.0
    assert time.perf_counter() - started < 0.1

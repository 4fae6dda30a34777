r"""math-verify accuracy with open-r1 semantics, and megarl's timeout around it.

Differential: by default (reward.math_verify_gold=open_r1) the gold is parsed as open-r1's
accuracy_reward parses it, `parse(gold, extraction_mode="first_match")`, and the sample skipped
(None) when nothing parses. The expected values follow from what that call extracts (written
next to each case), then from verify's equivalence. megarl's documented reading (formula) reads
a bare formula inside $…$ and skips a gold that reads as text."""

import threading

import pytest

from megarl.reward.math_verify_reward import gold_as_latex, is_text, math_verify_accuracy

# cases where both readings agree
BOTH = [
    ("The answer is $\\boxed{\\frac{1}{2}}$", "$\\frac{1}{2}$", 1.0),
    ("$\\boxed{0.5}$", "$\\frac{1}{2}$", 1.0),  # equivalence, not string equality
    ("\\boxed{\\sqrt{2}/2}", "$\\frac{\\sqrt{2}}{2}$", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),  # units stripped
    ("The final answer is $x = 5$", "5", 1.0),  # equation: its right-hand side
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{5}", 5, 1.0),  # a numeric gold
    ("\\boxed{3}", "4", 0.0),
    ("I think it is 5", "5", 0.0),  # no anchor (\boxed, "final answer"): nothing extracted
    ("", "5", 0.0),
    ("\\boxed{5}", "", None),  # unparseable gold: skipped, not 0
    ("\\boxed{5}", "\\", None),
    ("\\boxed{5}", "{", None),
    # text golds: skipped when nothing parses (issue 17: "$no math here$" was a product of letters)
    ("\\boxed{no math here}", "no math here", None),
    ("\\boxed{7}", "no math here", None),
    ("\\boxed{Paris}", "Paris", None),
    ("The answer is Paris.", "Paris", None),
    ("\\boxed{\\text{Paris}}", "Paris", None),
    ("\\boxed{5}", "The answer is 5", 1.0),  # a number is read out of the text
    ("\\boxed{6}", "The answer is 5", 0.0),
    ("\\boxed{5}", "5 cm", 1.0),
    ("\\boxed{xy}", "xy", None),
]
# bare formulas, where the readings differ: open-r1's parse reads "2\pi" as 2, "(-\infty, 2]" as
# 2 and "3 \text{ and } 4" as 4 (the last number), and finds nothing in "\sqrt{2}",
# "x^2+7x+10" or "\frac12"; megarl's formula reading reads each whole
OPEN_R1 = [
    ("\\boxed{2\\pi}", "2\\pi", 0.0),
    ("\\boxed{2}", "2\\pi", 1.0),
    ("\\boxed{3, 4}", "3 \\text{ and } 4", 0.0),
    ("\\boxed{4}", "3 \\text{ and } 4", 1.0),
    ("\\boxed{x^2+7x+10}", "x^2+7x+10", None),
    ("\\boxed{(-\\infty, 2]}", "(-\\infty, 2]", 0.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", None),
]
FORMULA = [
    ("\\boxed{2\\pi}", "2\\pi", 1.0),
    ("\\boxed{2}", "2\\pi", 0.0),
    ("\\boxed{3, 4}", "3 \\text{ and } 4", 1.0),
    ("\\boxed{4}", "3 \\text{ and } 4", 0.0),
    ("\\boxed{x^2+7x+10}", "x^2+7x+10", 1.0),
    ("\\boxed{(-\\infty, 2]}", "(-\\infty, 2]", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("The answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
]


@pytest.mark.parametrize("response, gold, expected", BOTH + OPEN_R1)
def test_math_verify_accuracy_reads_the_gold_as_open_r1(response, gold, expected):
    assert math_verify_accuracy(response, gold) == expected


@pytest.mark.parametrize("response, gold, expected", BOTH + FORMULA)
def test_math_verify_accuracy_formula_reading(response, gold, expected):
    assert math_verify_accuracy(response, gold, "formula") == expected


@pytest.mark.parametrize(
    "gold, expected",
    [
        ("2\\pi", "$2\\pi$"),
        ("The answer is $4$.", "The answer is $4$."),
        ("\\boxed{4}", "\\boxed{4}"),
        ("\\(4\\)", "\\(4\\)"),
        ("Paris", "Paris"),  # text is not wrapped
        ("no math here", "no math here"),
        ("3 \\text{ and } 4", "$3 \\text{ and } 4$"),
    ],
)
def test_gold_as_latex_wraps_only_bare_formulas(gold, expected):
    assert gold_as_latex(gold) == expected


@pytest.mark.parametrize(
    "gold, text",
    [
        ("Paris", True),
        ("no math here", True),
        ("The answer is 5", True),
        ("Zürich", True),
        ("東京", True),
        ("xy", True),  # two letters in a row read as a word
        ("5 cm", True),
        ("x", False),
        ("42", False),
        ("2\\pi", False),  # command names are not words
        ("\\sqrt{2}", False),
        ("x^2+7x+10", False),
        ("(-\\infty, 2]", False),
        ("3 \\text{ and } 4", False),  # nor the argument of a text command
        ("\\text{(C)}", False),
        ("\\mathrm{km}", False),
        ("", False),
    ],
)
def test_is_text(gold, text):
    assert is_text(gold) is text


def test_works_off_the_main_thread():
    # math-verify's own signal timers would raise here; megarl turns them off
    results = []
    thread = threading.Thread(target=lambda: results.append(math_verify_accuracy("\\boxed{7}", "7")))
    thread.start()
    thread.join()
    assert results == [1.0]

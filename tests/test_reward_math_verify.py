"""math-verify accuracy with open-r1 semantics, and megarl's timeout around it."""

import threading

import pytest

from megarl.reward.math_verify_reward import gold_as_latex, math_verify_accuracy


@pytest.mark.parametrize(
    "response, gold, expected",
    [
        ("The answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
        ("$\\boxed{0.5}$", "$\\frac{1}{2}$", 1.0),  # equivalence, not string equality
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("\\boxed{2\\pi}", "2\\pi", 1.0),
        ("\\boxed{2}", "2\\pi", 0.0),  # a bare gold is read as one formula, not "2" and text
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
    ],
)
def test_math_verify_accuracy(response, gold, expected):
    assert math_verify_accuracy(response, gold) == expected


@pytest.mark.parametrize(
    "gold, expected",
    [
        ("2\\pi", "$2\\pi$"),
        ("The answer is $4$.", "The answer is $4$."),
        ("\\boxed{4}", "\\boxed{4}"),
        ("\\(4\\)", "\\(4\\)"),
    ],
)
def test_gold_as_latex_wraps_only_bare_answers(gold, expected):
    assert gold_as_latex(gold) == expected


def test_works_off_the_main_thread():
    # math-verify's own signal timers would raise here; megarl turns them off
    results = []
    thread = threading.Thread(target=lambda: results.append(math_verify_accuracy("\\boxed{7}", "7")))
    thread.start()
    thread.join()
    assert results == [1.0]

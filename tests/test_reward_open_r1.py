"""open-r1 shaping rewards and DAPO soft overlong, with values worked out by hand; the format
and reasoning-step tables are differential: open-r1's regular expressions read by hand."""

import math

import pytest

from megarl.reward.open_r1 import (
    cosine_scaled_reward,
    format_reward,
    len_rewards,
    reasoning_steps_reward,
    repetition_penalty_reward,
    soft_overlong_reward,
    tag_count_reward,
)

STRICT = "<think>\nI add.\n</think>\n<answer>\n42\n</answer>"


# open-r1's format_reward: re.match (from the first character) of
# "^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$" under re.DOTALL | re.MULTILINE, so "$"
# holds at the end and before any newline. strict_end: the same without re.MULTILINE, where "$"
# holds at the end and before a final newline only.
@pytest.mark.parametrize(
    "response, open_r1, strict_end",
    [
        (STRICT, 1.0, 1.0),
        (STRICT + "\n", 1.0, 1.0),  # issue 17: one trailing newline
        (STRICT + "\n\n", 1.0, 0.0),  # "$" before the first of them
        (STRICT + "\nMore text after the answer.", 1.0, 0.0),  # what follows the newline is not read
        (STRICT + " extra", 0.0, 0.0),  # not a newline: "$" fails, and no later "\n</answer>" ends the text
        (STRICT + " ", 0.0, 0.0),
        (STRICT + "x\n</answer>", 1.0, 1.0),  # the answer block runs on to the last "\n</answer>"
        (" " + STRICT, 0.0, 0.0),  # from the first character
        ("\n" + STRICT, 0.0, 0.0),
        ("<think>\nline 1\nline 2\n</think>\n<answer>\n4\n2\n</answer>", 1.0, 1.0),
        ("<think>\n\n</think>\n<answer>\n\n</answer>", 1.0, 1.0),
        ("<think>I add.</think><answer>42</answer>", 0.0, 0.0),  # newlines are part of the format
        ("<think>\nI add.\n</think>\n\n<answer>\n42\n</answer>", 0.0, 0.0),  # one newline between blocks
        ("<answer>\n42\n</answer>", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_format_reward(response, open_r1, strict_end):
    assert format_reward(response) == open_r1
    assert format_reward(response, strict_end=True) == strict_end


@pytest.mark.parametrize(
    "response, expected",
    [
        (STRICT, 1.0),
        ("<think>\nI add.</think><answer>42</answer>", 0.25),  # only "<think>\n"
        ("<think>\na\n</think>\n<think>\nb\n</think>\n<answer>\nc\n</answer>", 0.5),  # think tags twice
        ("<think>a</think>\n<answer>\nc\n</answer>", 0.5),  # "\n<answer>\n" and "\n</answer>"
        ("", 0.0),
    ],
)
def test_tag_count_reward(response, expected):
    assert tag_count_reward(response) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Step 1: a. Step 2: b. Step 3: c.", 1.0),
        ("Step 1: a. Step 2: b. Step 3: c. Step 4: d.", 1.0),  # capped at 1
        ("First, a. Next, b.", 2 / 3),
        ("1. a\n2. b", 1 / 3),  # open-r1's "^\d+\." has no re.MULTILINE: only at the very start
        ("intro\n1. a\n2. b\n3. c", 0.0),
        ("1. a\n- b\n* c", 1.0),
        ("intro\n- a\n* b", 2 / 3),  # bullets after a newline
        ("Finally, done.", 1 / 3),
        ("step 1: lowercase does not count", 0.0),
        ("no steps here", 0.0),
        ("", 0.0),
    ],
)
def test_reasoning_steps_reward(response, expected):
    assert reasoning_steps_reward(response) == pytest.approx(expected)


@pytest.mark.parametrize(
    "lengths, correct, expected",
    [
        # min 10, max 30: λ = 0.5, 0.0, −0.5
        ([10, 20, 30], [True, True, False], [0.5, 0.0, -0.5]),
        ([10, 20, 30], [False, False, True], [0.0, 0.0, -0.5]),  # wrong: min(0, λ)
        # min 10, max 40: λ = 0.5, −0.5, 0.5 − 10/30 ≈ 0.17 → wrong and positive → 0
        ([10, 40, 20], [True, False, False], [0.5, -0.5, 0.0]),
        ([5, 5, 5], [True, False, True], [0.0, 0.0, 0.0]),  # max == min
        ([10, 30], [None, True], [None, -0.5]),  # unknown correctness is skipped
        ([], [], []),
    ],
)
def test_len_rewards(lengths, correct, expected):
    assert len_rewards(lengths, correct) == pytest.approx(expected)


def test_len_rewards_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="2 lengths but 1"):
        len_rewards([1, 2], [True])


@pytest.mark.parametrize(
    "length, correct, expected",
    [
        (0, True, 1.0),
        (1000, True, 0.5),
        (500, True, 0.75),  # cos(π/2) = 0: the midpoint
        (250, True, 0.5 + 0.25 * (1 + math.cos(math.pi / 4))),
        (0, False, -1.0),  # a short wrong answer is punished most
        (1000, False, -0.5),
        (500, False, -0.75),
        (2000, True, 0.5),  # past max_len: the end value, not back up the cosine
        (2000, False, -0.5),
        (10, None, None),
    ],
)
def test_cosine_scaled_reward(length, correct, expected):
    assert cosine_scaled_reward(length, correct) == pytest.approx(expected)


def test_cosine_scaled_reward_custom_range():
    assert cosine_scaled_reward(50, True, max_len=100, min_value_correct=0.0, max_value_correct=2.0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "response, ngram_size, max_penalty, expected",
    [
        ("a b c a b c", 3, -1.0, -0.25),  # 4 trigrams, 3 unique: (1 − 3/4)·(−1)
        ("A b a B", 2, -1.0, -1 / 3),  # lowercase: ab, ba, ab → 2 of 3 unique
        ("x x x x x", 1, -2.0, -1.6),  # (1 − 1/5)·(−2)
        ("all words differ here", 2, -1.0, 0.0),
        ("one two", 3, -1.0, 0.0),  # fewer words than n
        ("", 3, -1.0, 0.0),
    ],
)
def test_repetition_penalty_reward(response, ngram_size, max_penalty, expected):
    assert repetition_penalty_reward(response, ngram_size, max_penalty) == pytest.approx(expected)


def test_repetition_penalty_must_be_a_penalty():
    with pytest.raises(ValueError, match="max_penalty=0.5 must be <= 0"):
        repetition_penalty_reward("a a", 1, 0.5)


@pytest.mark.parametrize(
    "length, factor, expected",
    [
        (50, 1.0, 0.0),
        (80, 1.0, 0.0),  # the buffer starts at 100 − 20
        (90, 1.0, -0.5),
        (100, 1.0, -1.0),
        (120, 1.0, -1.0),  # clamped at −factor
        (90, 0.5, -0.25),
    ],
)
def test_soft_overlong_reward(length, factor, expected):
    assert soft_overlong_reward(length, max_response_length=100, buffer_len=20, penalty_factor=factor) == pytest.approx(expected)

"""The edges of the DAPO and Search-R1 rewards and of the reward routing that mutation testing
(`make mutants`) found unchecked: what reaches a reward function (data_source, extra_info),
a custom function's accuracy at a score of 0, answers read as Search-R1 reads them, formats
that only look valid, LaTeX spaces and stray dollars in a final answer, and the wording of the
errors. Expected values are worked out by hand."""

from __future__ import annotations

import re

import pytest

from megarl.reward.dapo_math import normalize_answer_lenient, unwrap_command
from megarl.reward.registry import compute_score, describe_routes, score_task
from megarl.reward.search_r1 import (
    extract_answer,
    golden_answers,
    is_valid_search_r1_format,
    search_r1_format_score,
)

SEEN = []


def noting_reward(data_source, solution_str, ground_truth, extra_info):
    """A custom reward (reward.custom_function=test_reward_edges:noting_reward) that notes its call."""
    SEEN.append((data_source, solution_str, ground_truth, extra_info))
    return {"score": 0.5}


def zero_reward(data_source, solution_str, ground_truth, extra_info):
    return 0.0


def zero_dict_reward(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0}


def text_reward(data_source, solution_str, ground_truth, extra_info):
    return "1.0"


def test_a_custom_function_gets_every_argument_and_acc_is_a_positive_score():
    SEEN.clear()
    out = score_task("test_reward_edges:noting_reward", "my_set", "the answer", "gt", {"index": 3}, {})
    assert SEEN == [("my_set", "the answer", "gt", {"index": 3})]
    assert out == {"score": 0.5, "acc": True}
    assert score_task("test_reward_edges:zero_reward", "s", "", "", None, {}) == {"score": 0.0, "acc": False,
                                                                                   "pred": None}
    assert score_task("test_reward_edges:zero_dict_reward", "s", "", "", None, {}) == {"score": 0.0, "acc": False}
    with pytest.raises(TypeError, match="^" + re.escape("reward function 'test_reward_edges:text_reward' returned "
                                                        "str; return a float or a dict with 'score'") + "$"):
        score_task("test_reward_edges:text_reward", "s", "", "", None, {})


@pytest.mark.parametrize("route", [
    lambda: compute_score("code", "print(1)", "not json", {"index": 7}),
    lambda: score_task(None, "code", "print(1)", "not json", {"index": 7}, {}),
    lambda: score_task("code", "other", "print(1)", "not json", {"index": 7}, {}),
])
def test_a_built_in_scorer_gets_extra_info_on_every_route(route):
    # the code reward names the row from extra_info's index when its verification_info is bad
    with pytest.raises(ValueError, match=r"^code reward, row 7: verification_info is not valid JSON"):
        route()


def test_the_routes_as_an_error_names_them():
    assert describe_routes() == (
        "2wikimultihopqa, bamboogle, hotpotqa, musique, nq, popqa, triviaqa, search* → search_r1_em; "
        "math, math_dapo, aime* → dapo_math; code → code; code_binary → code_binary; ioi → ioi; "
        "code_format → code_format")


def test_answers_are_read_pair_by_pair_from_the_left():
    # the second <answer> is closed by the first </answer> after it: its content keeps the third
    assert extract_answer("<answer>a</answer><answer>b<answer>c</answer>") == "b<answer>c"


@pytest.mark.parametrize("response", [
    "<think>a</think><think>b</answer>",  # a block closed by another tag
    "<think>a<think>b</think><answer>c</answer>",  # a tag opened inside its own block
    "x<think>a</think><answer>b</answer>",  # one character before the first block
])
def test_formats_that_only_look_valid_are_not(response):
    assert not is_valid_search_r1_format(response)


def test_the_format_score_defaults_to_nothing_for_a_wrong_answer_and_names_its_parts():
    out = search_r1_format_score("<answer>Rome</answer> trailing", {"target": ["Paris"]})
    assert out["score"] == 0.0
    assert (out["valid_format"], out["retrieval_correct"]) == (False, False)


def test_golden_answers_errors_say_what_to_store():
    with pytest.raises(ValueError, match="^" + re.escape("Search-R1 ground_truth dict has keys ['answers'] but no "
                                                         "'target'; store the golden answers as "
                                                         "{'target': [answer, ...]}") + "$"):
        golden_answers({"answers": ["Paris"]})
    with pytest.raises(TypeError, match="^" + re.escape("Search-R1 ground_truth of type int is not supported; give "
                                                        "a string, a list of strings or {'target': [...]}") + "$"):
        golden_answers(3)


@pytest.mark.parametrize("answer, expected", [
    (r"10\ cm", "10"),  # LaTeX's "\ " is a space: the unit after it goes
    ("5$", "5"),  # a stray dollar
    ("X.", "X"),  # the full stop goes, the letter stays
])
def test_lenient_normalisation(answer, expected):
    assert normalize_answer_lenient(answer) == expected


def test_every_command_is_unwrapped():
    assert unwrap_command(r"\text{a}\text{b}\text{c}", "text") == "abc"

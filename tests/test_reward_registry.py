"""Routing by data_source, compute_score, and custom functions by import string."""

import pytest

import reward_fixtures
from megarl.reward import compute_score
from megarl.reward.registry import (
    ROUTES,
    SCORER_OPTION_NAMES,
    SCORERS,
    as_score_dict,
    load_custom_function,
    scorer_for_data_source,
    score_task,
)

FIXTURES = reward_fixtures.__name__


@pytest.mark.parametrize(
    "data_source, scorer",
    [
        ("nq", "search_r1_em"),
        ("triviaqa", "search_r1_em"),
        ("popqa", "search_r1_em"),
        ("hotpotqa", "search_r1_em"),
        ("2wikimultihopqa", "search_r1_em"),
        ("musique", "search_r1_em"),
        ("bamboogle", "search_r1_em"),
        ("searchR1_nq", "search_r1_em"),  # any name starting with "search"
        ("search", "search_r1_em"),
        ("math_dapo", "dapo_math"),
        ("math", "dapo_math"),
        ("aime24", "dapo_math"),  # any name starting with "aime"
        ("aime_2025", "dapo_math"),
    ],
)
def test_routing_table(data_source, scorer):
    assert scorer_for_data_source(data_source) is SCORERS[scorer]


@pytest.mark.parametrize("data_source", ["gsm8k", "NQ", "mathematics", "", "research"])
def test_unknown_data_source_names_it_and_says_how_to_plug_one(data_source):
    with pytest.raises(ValueError) as error:
        scorer_for_data_source(data_source)
    message = str(error.value)
    assert repr(data_source) in message
    assert "nq" in message and "math_dapo" in message and "aime*" in message  # the known sources
    assert "module.path:function" in message and "custom_function" in message


def test_routes_point_at_registered_scorers():
    assert {route.scorer for route in ROUTES} <= set(SCORERS)


@pytest.mark.parametrize(
    "data_source, response, ground_truth, options, expected",
    [
        ("nq", "<answer>Paris</answer>", {"target": ["Paris"]}, {}, {"score": 1.0, "acc": True, "pred": "Paris"}),
        ("hotpotqa", "<answer>Lyon</answer>", ["Paris"], {"format_score": 0.1}, {"score": 0.1, "acc": False, "pred": "Lyon"}),
        ("math_dapo", "Answer: 7", "7", {}, {"score": 1.0, "acc": True, "pred": "7"}),
        ("aime24", "Answer: 8", "7", {"format_score": 0.1}, {"score": -1.0, "acc": False, "pred": "8"}),  # option not taken
        ("math_dapo", "Answer: 7.", "7", {}, {"score": -1.0, "acc": False, "pred": "7."}),  # verl's normalisation
        ("math_dapo", "Answer: 7.", "7", {"dapo_math_normalization": "lenient"}, {"score": 1.0, "acc": True, "pred": "7"}),
    ],
)
def test_compute_score_routes_and_passes_options(data_source, response, ground_truth, options, expected):
    assert compute_score(data_source, response, ground_truth, None, **options) == expected


def test_compute_score_rejects_unknown_options():
    with pytest.raises(TypeError, match="formatscore"):
        compute_score("nq", "<answer>x</answer>", "x", formatscore=0.1)


def test_scorer_options_exist_on_every_scorer():
    assert set(SCORER_OPTION_NAMES) == {
        "format_score", "structure_format_score", "final_format_score", "retrieval_score", "dapo_math_normalization",
        "code_sandbox_url", "code_wall_s", "code_memory_mb",
    }


def test_named_scorer_ignores_data_source():
    result = score_task("search_r1_format", "gsm8k", "<answer>Paris</answer>", "Paris", None, {"structure_format_score": 0.2})
    assert result["score"] == pytest.approx(0.8)  # correct answer, no <think>: 1 − 0.2


def test_custom_function_by_import_string():
    assert score_task(f"{FIXTURES}:flexible_score", "x", "a", "a", None, {})["score"] == 1.0  # any fit is taken
    result = score_task(f"{FIXTURES}:length_score", "anything", "abcd", "4", None, {})
    assert result == {"score": 0.04, "acc": True, "pred": "abcd"}
    assert score_task(f"{FIXTURES}:float_score", "x", "a", "a", None, {}) == {"score": 0.5, "acc": True, "pred": None}


@pytest.mark.parametrize(
    "import_string, message",
    [
        ("reward_fixtures", "module.path:function"),  # no ':'
        (":length_score", "module.path:function"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        (f"{FIXTURES}:missing_fn", "has no attribute 'missing_fn'"),
        (f"{FIXTURES}:NOT_A_FUNCTION", "names a int, not a function"),
        (f"{FIXTURES}:scorer_shaped", "takes (solution_str, ground_truth, extra_info=None), but megarl calls it as "
                                      "fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict "
                                      "(too many positional arguments)"),
        (f"{FIXTURES}:keyword_only_score", "takes (*, data_source, solution_str, ground_truth, extra_info=None), but"),
    ],
)
def test_bad_import_string_names_it_and_the_expected_form(import_string, message):
    with pytest.raises(ValueError) as error:
        load_custom_function(import_string)
    assert repr(import_string) in str(error.value)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "value, expected",
    [
        (1, {"score": 1.0, "acc": True, "pred": None}),
        (-0.5, {"score": -0.5, "acc": False, "pred": None}),
        ({"score": 2}, {"score": 2.0, "acc": True}),
        ({"score": 1.0, "acc": False, "extra": 3}, {"score": 1.0, "acc": False, "extra": 3}),
    ],
)
def test_as_score_dict(value, expected):
    assert as_score_dict(value, "fn") == expected


@pytest.mark.parametrize("value, message", [({"acc": True}, "without 'score'"), ("1.0", "returned str")])
def test_as_score_dict_rejects(value, message):
    with pytest.raises(TypeError, match=message):
        as_score_dict(value, "fn")

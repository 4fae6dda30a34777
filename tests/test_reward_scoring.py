"""RewardConfig → score_one → apply_group_rewards: task score, weighted components,
correctness for the length components, group-level len, and validation of the settings."""

import dataclasses

import pytest

import reward_fixtures
from megarl.reward.registry import SCORER_OPTION_NAMES
from megarl.config import AlgorithmConfig, ConfigError, OverlongConfig, load_config
from megarl.experience import shape_overlong
from megarl.reward.scoring import (
    COMPONENT_NAMES,
    RewardRequest,
    RewardResult,
    apply_group_rewards,
    characters_read,
    combine_rewards,
    failed_result,
    score_one,
    warm_up,
)
from megarl.reward.settings import RewardConfig

FIXTURES = reward_fixtures.__name__
STRICT_BOXED_2 = "<think>\nStep 1: 1 + 1.\n</think>\n<answer>\n$\\boxed{2}$\n</answer>"


@pytest.mark.parametrize(
    "components, weights, expected",
    [
        ({"accuracy": 1.0, "format": 1.0}, {"accuracy": 2.0, "format": 0.5}, 2.5),
        ({"accuracy": None, "format": 1.0}, {"accuracy": 1.0, "format": 0.5}, 0.5),  # None left out
        ({"accuracy": 1.0}, {"accuracy": 1.0, "len": 3.0}, 1.0),  # absent: left out too
        ({"accuracy": 1.0, "format": 1.0}, {"format": 1.0}, 1.0),  # unweighted component ignored
        ({"accuracy": None}, {"accuracy": 1.0}, 0.0),
        ({}, {}, 0.0),
    ],
)
def test_combine_rewards(components, weights, expected):
    assert combine_rewards(components, weights) == pytest.approx(expected)


def test_combine_rewards_rejects_unknown_weight_names():
    with pytest.raises(ValueError) as error:
        combine_rewards({"accuracy": 1.0}, {"acuracy": 1.0})
    assert "'acuracy'" in str(error.value)
    assert all(name in str(error.value) for name in COMPONENT_NAMES)


def test_spec_has_a_field_for_every_scorer_option():
    fields = {f.name for f in dataclasses.fields(RewardConfig)}
    assert set(SCORER_OPTION_NAMES) <= fields


@pytest.mark.parametrize(
    "spec, request_, expected",
    [
        # empty weights: the routed task score alone
        (RewardConfig(), RewardRequest("nq", "<answer>Paris</answer>", {"target": ["Paris"]}),
         RewardResult(1.0, True, "Paris", {"task_score": 1.0})),
        (RewardConfig(format_score=0.1), RewardRequest("nq", "<answer>Lyon</answer>", ["Paris"]),
         RewardResult(0.1, False, "Lyon", {"task_score": 0.1})),
        (RewardConfig(), RewardRequest("math_dapo", "Answer: 3", "4"),
         RewardResult(-1.0, False, "3", {"task_score": -1.0})),
        # a named scorer from the config, whatever the data_source
        (RewardConfig(custom_function="search_r1_format", structure_format_score=0.2),
         RewardRequest("my_qa", "<answer>Paris</answer>", "Paris"),
         RewardResult(0.8, True, "Paris", {"task_score": 0.8})),
        # a custom function by import string
        (RewardConfig(custom_function=f"{FIXTURES}:float_score"), RewardRequest("x", "a", "a"),
         RewardResult(0.5, True, None, {"task_score": 0.5})),
        # open-r1 style: accuracy 1 + 0.5·format 1 + 0.25·reasoning_steps (1 step → 1/3)
        (RewardConfig(weights={"accuracy": 1.0, "format": 0.5, "reasoning_steps": 0.25}),
         RewardRequest("any", STRICT_BOXED_2, "2"),
         RewardResult(1.0 + 0.5 + 0.25 / 3, True, None, {"accuracy": 1.0, "format": 1.0, "reasoning_steps": 1 / 3})),
        # unparseable gold: accuracy skipped, acc False, the rest still counts
        (RewardConfig(weights={"accuracy": 1.0, "tag_count": 1.0}), RewardRequest("any", STRICT_BOXED_2, ""),
         RewardResult(1.0, False, None, {"accuracy": None, "tag_count": 1.0})),
        # cosine with correctness from the task score; megarl's length in tokens (500 of 1000 → 0.75)
        (RewardConfig(weights={"task_score": 1.0, "cosine_scaled": 1.0}, length_rewards="megarl"),
         RewardRequest("math_dapo", "Answer: 4", "4", response_length=500),
         RewardResult(1.75, True, "4", {"task_score": 1.0, "cosine_scaled": 0.75})),
        # open-r1's: its own check of correctness (the gold read as LaTeX only), lengths in
        # characters: "\\boxed{4}" is 9 of 18 → 0.75, whatever the tokens
        (RewardConfig(weights={"cosine_scaled": 1.0}, cosine_max_len=18),
         RewardRequest("any", "\\boxed{4}", "$4$", response_length=500),
         RewardResult(0.75, False, None, {"cosine_scaled": 0.75})),
        # ... a bare gold "4" does not parse as LaTeX: open-r1 gives 1.0 even to a wrong answer;
        # megarl takes the correctness from accuracy (wrong: -0.5 - 0.5·0.5 = -0.75 at 9 of 18)
        (RewardConfig(weights={"cosine_scaled": 1.0}, cosine_max_len=18),
         RewardRequest("any", "\\boxed{3}", "4"), RewardResult(1.0, False, None, {"cosine_scaled": 1.0})),
        (RewardConfig(weights={"accuracy": 0.0, "cosine_scaled": 1.0}, cosine_max_len=18, length_rewards="megarl"),
         RewardRequest("any", "\\boxed{3}", "4"),
         RewardResult(-0.75, False, None, {"accuracy": 0.0, "cosine_scaled": -0.75})),
        # past max_len (9 characters of 6, t = 1.5): open-r1 follows the cosine back up to 0.75,
        # megarl holds the end value 0.5
        (RewardConfig(weights={"cosine_scaled": 1.0}, cosine_max_len=6),
         RewardRequest("any", "\\boxed{4}", "$4$"), RewardResult(0.75, False, None, {"cosine_scaled": 0.75})),
        (RewardConfig(weights={"accuracy": 0.0, "cosine_scaled": 1.0}, cosine_max_len=6, length_rewards="megarl"),
         RewardRequest("any", "\\boxed{4}", "$4$"),
         RewardResult(0.5, True, None, {"accuracy": 1.0, "cosine_scaled": 0.5})),
        # a gold that does not parse: open-r1 gives cosine 1.0, megarl skips it
        (RewardConfig(weights={"accuracy": 0.0, "cosine_scaled": 1.0}), RewardRequest("any", STRICT_BOXED_2, ""),
         RewardResult(1.0, False, None, {"accuracy": None, "cosine_scaled": 1.0})),
        (RewardConfig(weights={"accuracy": 0.0, "cosine_scaled": 1.0}, length_rewards="megarl"),
         RewardRequest("any", STRICT_BOXED_2, ""),
         RewardResult(0.0, False, None, {"accuracy": None, "cosine_scaled": None})),
        # ... and from math-verify accuracy with weight 0; length in characters without response_length
        (RewardConfig(weights={"accuracy": 0.0, "cosine_scaled": 1.0}, cosine_max_len=len(STRICT_BOXED_2),
                      length_rewards="megarl"),
         RewardRequest("any", STRICT_BOXED_2, "3"),
         RewardResult(-0.5, False, None, {"accuracy": 0.0, "cosine_scaled": -0.5})),
        # the DAPO normalisation and the format check's end, as the config picks them
        (RewardConfig(), RewardRequest("math_dapo", "Answer: 628.", "628"),
         RewardResult(-1.0, False, "628.", {"task_score": -1.0})),
        (RewardConfig(dapo_math_normalization="lenient"), RewardRequest("math_dapo", "Answer: 628.", "628"),
         RewardResult(1.0, True, "628", {"task_score": 1.0})),
        (RewardConfig(weights={"format": 1.0}), RewardRequest("any", STRICT_BOXED_2 + "\nP.S.", "2"),
         RewardResult(1.0, False, None, {"format": 1.0})),
        (RewardConfig(weights={"format": 1.0}, format_strict_end=True), RewardRequest("any", STRICT_BOXED_2 + "\nP.S.", "2"),
         RewardResult(0.0, False, None, {"format": 0.0})),
        # math-verify's reading of a bare gold: open-r1's ("2\\pi" reads as 2) or megarl's (whole)
        (RewardConfig(weights={"accuracy": 1.0}), RewardRequest("any", "\\boxed{2}", "2\\pi"),
         RewardResult(1.0, True, None, {"accuracy": 1.0})),
        (RewardConfig(weights={"accuracy": 1.0}, math_verify_gold="formula"),
         RewardRequest("any", "\\boxed{2}", "2\\pi"), RewardResult(0.0, False, None, {"accuracy": 0.0})),
        (RewardConfig(weights={"repetition_penalty": 1.0}, repetition_ngram_size=1, repetition_max_penalty=-2.0),
         RewardRequest("any", "x x x x x", "1"),
         RewardResult(-1.6, False, None, {"repetition_penalty": -1.6})),
    ],
)
def test_score_one(spec, request_, expected):
    result = score_one(spec, request_)
    assert result.score == pytest.approx(expected.score)
    assert (result.acc, result.pred) == (expected.acc, expected.pred)
    assert result.components == pytest.approx(expected.components)
    assert result.error is None


def test_dapo_reward_is_the_task_score_then_the_overlong_penalty_once():
    # DAPO recipe: task score 1, then algorithm.overlong (max 100, buffer 20; 90 tokens → −0.5)
    result = score_one(RewardConfig(), RewardRequest("math_dapo", "Answer: 4", "4", response_length=90))
    assert (result.score, result.acc, result.components) == (1.0, True, {"task_score": 1.0})
    algo = AlgorithmConfig(overlong=OverlongConfig(enable=True, buffer_len=20, penalty_factor=1.0))
    assert shape_overlong([result.score], [90], 100, algo) == pytest.approx([0.5])


def test_group_len_reward_by_group_id():
    spec = RewardConfig(weights={"task_score": 0.0, "len": 1.0}, length_rewards="megarl")  # lengths in tokens
    requests = [
        RewardRequest("math", "Answer: 1", "1", group_id="a", response_length=10),  # correct, shortest
        RewardRequest("math", "Answer: 2", "1", group_id="a", response_length=20),  # wrong, λ = 0
        RewardRequest("math", "Answer: 1", "1", group_id="a", response_length=30),  # correct, longest
        RewardRequest("math", "Answer: 1", "1", group_id="b", response_length=99),  # a group of one
        RewardRequest("math", "Answer: 1", "1", group_id=None, response_length=5),  # no group
        RewardRequest("math", "Answer: 1", "1", group_id="a", response_length=1),  # failed: takes no part
    ]
    results = [score_one(spec, r) for r in requests[:5]] + [failed_result("boom")]
    grouped = apply_group_rewards(spec, requests, results)
    assert [r.components.get("len") for r in grouped] == [0.5, 0.0, -0.5, 0.0, 0.0, None]
    assert [r.score for r in grouped] == [0.5, 0.0, -0.5, 0.0, 0.0, 0.0]
    assert grouped[5].error == "boom"


@pytest.mark.parametrize("reading, expected", [
    # characters 9, 18, 29 → λ = 0.5, 0.05, -0.5; the wrong one gets min(0, λ) = 0; the third,
    # whose gold does not parse, counts as correct in open-r1 (λ) and is skipped by megarl
    ("open_r1", [0.5, 0.0, -0.5]),
    ("megarl", [0.5, 0.0, None]),
])
def test_group_len_reward_with_a_gold_that_does_not_parse(reading, expected):
    spec = RewardConfig(weights={"accuracy": 0.0, "len": 1.0}, length_rewards=reading)
    requests = [RewardRequest("any", "\\boxed{1}", "$1$", group_id="a"),  # correct
                RewardRequest("any", "\\boxed{2} and more", "$1$", group_id="a"),  # wrong
                RewardRequest("any", "\\boxed{1} then some more text", "", group_id="a")]
    grouped = apply_group_rewards(spec, requests, [score_one(spec, r) for r in requests])
    assert [r.components["len"] for r in grouped] == pytest.approx(expected)


def test_group_step_is_a_no_op_without_len():
    spec = RewardConfig()
    requests = [RewardRequest("math", "Answer: 1", "1", group_id="a")]
    results = [score_one(spec, requests[0])]
    assert apply_group_rewards(spec, requests, results) is results


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weights": {"acuracy": 1.0}}, "unknown reward weight names \\['acuracy'\\]"),
        ({"weights": {"format": float("nan")}}, "must be a finite number"),
        ({"custom_function": "my_reward"}, "'module.path:function'"),
        ({"repetition_max_penalty": 1.0}, "reward.repetition_max_penalty: 1.0 is out of range"),
        # the overlong penalty is algorithm.overlong, not a reward component: it would count twice
        ({"weights": {"task_score": 1.0, "soft_overlong": 1.0}},
         "reward.weights: names soft_overlong, but the overlong penalty is algorithm.overlong"),
        ({"weights": {"cosine_scaled": 1.0, "format": 1.0}, "length_rewards": "megarl"}, "add 'accuracy'"),
        ({"weights": {"len": 1.0}, "length_rewards": "megarl"}, "nothing measures correctness"),
        ({"cosine_max_len": 0}, "reward.cosine_max_len: 0 is out of range"),
        ({"custom_function": "dapo_math", "weights": {"format": 1.0}}, "is never called"),
        ({"data_sources": {"mine": "dapo"}}, "reward.data_sources.mine: 'dapo' is neither a built-in scorer"),
        ({"data_sources": {"mine": "dapo_math"}, "custom_function": "search_r1_em"},
         r"reward.data_sources: \['mine'\] are never consulted: reward.custom_function='search_r1_em' scores every row"),
        ({"dapo_math_normalization": "minerva"}, "reward.dapo_math_normalization: 'minerva' is not a normalisation"),
        ({"math_verify_gold": "sympy"}, "reward.math_verify_gold: 'sympy' is not a reading of the gold answer"),
        ({"length_rewards": "kimi"}, "reward.length_rewards: 'kimi' is not a way of computing the length rewards"),
    ],
)
def test_spec_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardConfig(**kwargs)


def test_the_reward_options_from_the_run_config():
    cfg = load_config(None, ["reward.dapo_math_normalization=lenient", "reward.format_strict_end=true",
                             "reward.math_verify_gold=formula"])
    assert (cfg.reward.dapo_math_normalization, cfg.reward.format_strict_end, cfg.reward.math_verify_gold) == (
        "lenient", True, "formula")
    assert (RewardConfig().dapo_math_normalization, RewardConfig().format_strict_end,
            RewardConfig().math_verify_gold) == ("verl", False, "open_r1")
    with pytest.raises(ConfigError, match="reward.dapo_math_normalization: expects one of 'verl', 'lenient'"):
        load_config(None, ["reward.dapo_math_normalization=minerva"])


def test_a_data_set_is_routed_to_its_scorer_by_the_config():
    """reward.data_sources: a new data_source gets a built-in scorer or a function of its own
    without an edit of megarl/reward/registry.py; the built-in routes still serve the others."""
    cfg = RewardConfig(data_sources={"my_math": "dapo_math", "my_len": f"{FIXTURES}:length_score",
                                     "nq": f"{FIXTURES}:float_score"})  # a built-in route overridden
    def score(data_source, text, truth):
        return score_one(cfg, RewardRequest(data_source, text, truth)).score

    assert score("my_math", "so Answer: 12", "12") == 1.0 and score("my_math", "Answer: 13", "12") == -1.0  # DAPO's
    assert score("my_len", "abcd", "4") == pytest.approx(0.04)  # length_score: 1% a character
    assert score("nq", "paris", "paris") == 0.5 and score("nq", "rome", "paris") == -0.5
    assert score("triviaqa", "<answer>Paris</answer>", {"target": ["paris"]}) == 1.0  # its built-in route, EM
    assert characters_read(cfg, "my_math") == 300 and characters_read(cfg, "my_len") is None
    with pytest.raises(ValueError, match=r"no reward function for data_source 'other'.*reward.data_sources \({other:"):
        score("other", "x", "y")


def test_a_configured_function_of_another_signature_stops_the_start():
    with pytest.raises(ValueError, match=r"'reward_fixtures:scorer_shaped' takes \(solution_str, ground_truth"):
        warm_up(RewardConfig(data_sources={"mine": f"{FIXTURES}:scorer_shaped"}))

"""Search-R1 exact match and its format-aware variant: answer extraction, SQuAD
normalisation, ground-truth shapes, tag structure and the v0.3 score table."""

import time

import numpy as np
import pytest

from megarl.reward.search_r1 import (
    extract_answer,
    golden_answers,
    is_valid_search_r1_format,
    normalize_answer,
    retrieval_found_answer,
    search_r1_em_score,
    search_r1_format_score,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The  Eiffel Tower!", "eiffel tower"),
        ("An apple a day", "apple day"),
        ("theater another", "theater another"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("Rock-'n'-roll", "rocknroll"),
        ("Zürich", "zürich"),  # non-ASCII letters are kept, not folded
        ("北京市", "北京市"),
        ("«Paris»", "«paris»"),  # only ASCII punctuation is removed
        ("  \t\n ", ""),
        ("", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


# Search-R1's extract_solution, read by hand: non-overlapping matches of
# <answer>(.*?)</answer> (re.DOTALL) from the left, the last one stripped (one pair is enough
# here, as megarl scores the response without the prompt's example answer).
@pytest.mark.parametrize(
    "response, expected",
    [
        ("<answer>Paris</answer>", "Paris"),
        ("<answer>  Paris \n</answer>", "Paris"),
        ("<answer>\nNew\nYork\n</answer>", "New\nYork"),  # the content may span lines
        ("<answer>a</answer> then <answer>b</answer>", "b"),  # the last one
        ("<answer>a</answer> then <answer>b", "a"),  # trailing unclosed tag ignored
        ("<answer>b", None),  # unclosed only: no answer
        ("b</answer>", None),
        ("</answer><answer>", None),
        ("<answer>wrong<answer>Paris</answer>", "wrong<answer>Paris"),  # issue 17: the outer pair, tag and all
        ("<answer><answer>x</answer></answer>", "<answer>x"),  # the first </answer> closes the first <answer>
        ("<answer>x<answer>y</answer>z</answer>", "x<answer>y"),
        ("<answer>a</answer></answer>", "a"),  # stray closing tag
        ("<answer>a</answer><answer>b</answer>c</answer>", "b"),
        ("<answer></answer>", ""),
        ("<answer>東京</answer>", "東京"),
        ("", None),
        ("no tags at all", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    "ground_truth, expected",
    [
        ({"target": ["Paris", "paris, france"]}, ["Paris", "paris, france"]),
        ({"target": np.array(["Lyon", "Paris"], dtype=object)}, ["Lyon", "Paris"]),  # as parquet gives it
        ({"target": "Paris"}, ["Paris"]),
        ("Paris", ["Paris"]),
        (["Paris", "Lyon"], ["Paris", "Lyon"]),
        (np.array(["Paris"]), ["Paris"]),
    ],
)
def test_golden_answers_accepts_every_shape(ground_truth, expected):
    assert golden_answers(ground_truth) == expected


def test_golden_answers_dict_without_target_says_what_to_store():
    with pytest.raises(ValueError, match="target"):
        golden_answers({"answers": ["Paris"]})


@pytest.mark.parametrize(
    "response, ground_truth, format_score, expected_score, expected_acc",
    [
        ("<answer>Paris</answer>", {"target": ["paris"]}, 0.0, 1.0, True),
        ("<answer>The Paris.</answer>", ["Lyon", "paris"], 0.0, 1.0, True),
        ("<answer>Paris</answer>", {"target": np.array(["Lyon", "Paris"], dtype=object)}, 0.0, 1.0, True),
        ("<answer>London</answer>", "Paris", 0.1, 0.1, False),  # answered, wrong: format_score
        ("Paris", "Paris", 0.1, 0.0, False),  # no answer tag: 0 even with format_score
        ("<answer>Paris", "Paris", 0.1, 0.0, False),  # unclosed: no answer
        ("<answer>Zurich</answer>", "Zürich", 0.0, 0.0, False),  # no accent folding
        ("<answer>zürich</answer>", "Zürich", 0.0, 1.0, True),
        ("<answer>東京</answer>", ["東京"], 0.0, 1.0, True),
        ("<answer>Paris</answer><answer>London</answer>", "Paris", 0.0, 0.0, False),  # the last answer counts
        ("<answer>wrong<answer>Paris</answer>", "Paris", 0.0, 0.0, False),  # issue 17: "wrong answer paris" ≠ "paris"
        ("<answer>wrong<answer>Paris</answer>", "Paris", 0.1, 0.1, False),  # an answer, a wrong one
        ("<answer>Paris<answer>Paris</answer>", "Paris", 0.0, 0.0, False),
        ("", "Paris", 0.0, 0.0, False),
    ],
)
def test_search_r1_em_score(response, ground_truth, format_score, expected_score, expected_acc):
    result = search_r1_em_score(response, ground_truth, format_score=format_score)
    assert result["score"] == pytest.approx(expected_score)
    assert result["acc"] is expected_acc


THINK, ANSWER = "<think>plan</think>", "<answer>Paris</answer>"
ROUND = "<search>capital of France</search><information>Doc 1(Title: Paris) Paris is the capital.</information><think>ok</think>"


@pytest.mark.parametrize(
    "response, valid",
    [
        (THINK + ANSWER, True),
        (THINK + ROUND + ANSWER, True),
        (THINK + ROUND + ROUND + ANSWER, True),
        ("\n  " + THINK + "\n" + ROUND.replace("><", ">\n\t<") + "\n" + ANSWER + "\n\n", True),  # white space between
        ("<think></think><answer></answer>", True),  # empty blocks are still blocks
        (ANSWER, False),  # no think first
        (THINK + "hello" + ANSWER, False),  # text between blocks
        ("Sure! " + THINK + ANSWER, False),  # text before
        (THINK + ANSWER + "<|im_end|>", False),  # text after
        (THINK + "<search>q</search>" + ANSWER, False),  # search without information
        (THINK + "<search>q</search><information>d</information>" + ANSWER, False),  # no think after information
        ("<think>a<search>q</search></think>" + ANSWER, False),  # nested tags
        (THINK + "<answer>Paris", False),  # unclosed
        (THINK + ANSWER + ANSWER, False),  # two answers
        (THINK + THINK + ANSWER, False),
        ("<think>a</search>" + ANSWER, False),  # mismatched close
        ("", False),
    ],
)
def test_is_valid_search_r1_format(response, valid):
    assert is_valid_search_r1_format(response) is valid


@pytest.mark.parametrize(
    "response, answers, found",
    [
        ("<information>the city of PARIS, France</information>", ["Paris"], True),  # normalised substring
        ("<information>Lyon</information><information>Paris</information>", ["Paris"], True),
        ("<information>Lyon</information> Paris", ["Paris"], False),  # outside the blocks
        ("<information>The</information>", ["the"], False),  # golden answer normalising to "" is ignored
        ("no blocks", ["Paris"], False),
    ],
)
def test_retrieval_found_answer(response, answers, found):
    assert retrieval_found_answer(response, answers) is found


RETRIEVED_GOLD = "<search>q</search><information>Paris is the capital.</information><think>t</think>"
RETRIEVED_OTHER = "<search>q</search><information>London is big.</information><think>t</think>"


# structure_format_score=0.2, final_format_score=0.1, retrieval_score=0.3: every branch
# of the v0.3 table gives a different number.
@pytest.mark.parametrize(
    "response, expected",
    [
        (THINK + RETRIEVED_GOLD + "<answer>Paris</answer>", 1.0),  # correct, valid
        ("<answer>Paris</answer>", 0.8),  # correct, invalid: 1 − structure
        (THINK + RETRIEVED_GOLD + "<answer>London</answer>", 0.5),  # wrong, valid, retrieval hit: 0.2 + 0.3
        (THINK + RETRIEVED_OTHER + "<answer>London</answer>", 0.2),  # wrong, valid, no retrieval hit
        ("<answer>London</answer>", 0.1),  # wrong, invalid: final_format_score
        ("<information>Paris</information><answer>London</answer>", 0.1),  # retrieval bonus needs a valid format
        ("<think>I do not know", 0.0),  # no answer, invalid
        ("<think>t</think><information>Paris</information>", 0.0),
    ],
)
def test_search_r1_format_score_table(response, expected):
    result = search_r1_format_score(
        response, {"target": ["Paris"]}, structure_format_score=0.2, final_format_score=0.1, retrieval_score=0.3
    )
    assert result["score"] == pytest.approx(expected)
    assert result["acc"] is (expected in (1.0, 0.8))


def test_format_score_defaults_reduce_to_exact_match():
    assert search_r1_format_score("<answer>Paris</answer>", "Paris")["score"] == 1.0
    assert search_r1_format_score(THINK + RETRIEVED_GOLD + "<answer>x</answer>", "Paris")["score"] == 0.0


def test_one_megabyte_responses_score_fast():
    filler = "lorem ipsum dolor sit amet " * 40_000  # ~1 MB
    responses = [
        "<think>" + filler + "</think><answer>Paris</answer>",
        filler,
        "<answer>" * 100_000 + "</answer>" * 100_000,
        "<think>x</think>" * 60_000,
        "<answer>" + filler + "</answer>",
        "<answer>" * 100_000,  # no pair: a scan that restarts at every opening tag would be quadratic
    ]
    started = time.perf_counter()
    results = [search_r1_format_score(r, {"target": ["Paris"]}) for r in responses]
    results += [search_r1_em_score(r, {"target": ["Paris"]}) for r in responses]
    assert time.perf_counter() - started < 2.0
    assert [r["score"] for r in results[6:]] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert results[0]["score"] == 1.0

"""Search-R1 rewards: exact match of the last <answer> against golden answers, and the
format-aware variant of Search-R1 v0.3 that also grades the tag structure and whether
retrieval surfaced a golden answer.

Main entry points: `search_r1_em_score` (data_source routing) and `search_r1_format_score`
(named scorer "search_r1_format").

`solution_str` is the decoded response only (special tokens skipped), never the prompt:
the original code received prompt + response and had to skip the few-shot <answer> of
the prompt; here every <answer> in the text was written by the policy or the agent loop.
Otherwise the exact match gives Search-R1's answers (verl/utils/reward_score/qa_em.py):
the same answer extraction and the same SQuAD normalisation.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import Any

from megarl.reward.scorers import register_scorer

_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"
_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_TAG = re.compile(r"<(/?)(think|search|information|answer)>")
_INFORMATION_BLOCK = re.compile(r"<information>(.*?)</information>", re.DOTALL)
# The agent loop writes: think, then any number of (search → retrieved information →
# think) rounds, then the answer. Checked as a regular language over the block names.
_VALID_BLOCK_SEQUENCE = re.compile(r"think( search information think)* answer")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop ASCII punctuation, drop the articles a/an/the
    as whole words, collapse white space. Non-ASCII letters (Zürich, 東京) are kept."""
    text = text.lower().translate(_DROP_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def golden_answers(ground_truth: Any) -> list[str]:
    """The golden answers as a list of strings.

    Accepts {"target": answers} (answers a list, a numpy array as parquet returns it, or
    one string), a plain string, or any iterable of strings.
    """
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError(
                f"Search-R1 ground_truth dict has keys {sorted(ground_truth)} but no 'target'; "
                "store the golden answers as {'target': [answer, ...]}"
            )
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, str):
        return [ground_truth]
    if isinstance(ground_truth, Iterable):
        return [str(answer) for answer in ground_truth]
    raise TypeError(
        f"Search-R1 ground_truth of type {type(ground_truth).__name__} is not supported; "
        "give a string, a list of strings or {'target': [...]}"
    )


def extract_answer(response: str) -> str | None:
    """Content of the last <answer>…</answer> pair, stripped, with pairs read as Search-R1
    reads them (qa_em.extract_solution): from the left, each <answer> closed by the first
    </answer> after it, the next pair searched after that close. A nested or repeated opening
    tag is part of the content ("<answer>wrong<answer>Paris</answer>" → "wrong<answer>Paris",
    which matches no golden answer); a trailing unclosed <answer> is ignored. None when the
    response holds no complete pair.

    Search-R1 scores the prompt and the response together and so skips the prompt's example
    answer (no answer unless there are two pairs); megarl scores the response alone, so one
    pair is enough.
    """
    answer = None
    start = response.find(_ANSWER_OPEN)
    while start >= 0:
        close = response.find(_ANSWER_CLOSE, start + len(_ANSWER_OPEN))
        if close < 0:
            break
        answer = response[start + len(_ANSWER_OPEN):close]
        start = response.find(_ANSWER_OPEN, close + len(_ANSWER_CLOSE))
    return None if answer is None else answer.strip()


def exact_match(prediction: str, answers: list[str]) -> bool:
    """True when the normalised prediction equals any normalised golden answer."""
    normalized = normalize_answer(prediction)
    return any(normalized == normalize_answer(answer) for answer in answers)


@register_scorer("search_r1_em", options=("format_score",), prefixes=("search",),
                 data_sources=("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"))
def search_r1_em_score(
    solution_str: str, ground_truth: Any, extra_info: dict | None = None, *, format_score: float = 0.0
) -> dict:
    """Exact-match reward: 1.0 when the last <answer> matches a golden answer,
    `format_score` when an answer was given but is wrong, 0.0 when there is none."""
    answer = extract_answer(solution_str)
    correct = answer is not None and exact_match(answer, golden_answers(ground_truth))
    if answer is None:
        score = 0.0
    else:
        score = 1.0 if correct else format_score
    return {"score": score, "acc": correct, "pred": answer}


def is_valid_search_r1_format(response: str) -> bool:
    """Whether the response follows the Search-R1 agent structure exactly.

    Valid: <think>…</think> ( <search>…</search> <information>…</information>
    <think>…</think> )* <answer>…</answer>. Inside a block anything but one of the eight
    tags is allowed (tags do not nest); between blocks, before the first and after the
    last only white space (spaces, tabs, newlines) is allowed. Tags are exact and
    lowercase; any other text, such as a chat end token left in the decoded response,
    makes the format invalid.
    """
    blocks: list[str] = []
    open_name: str | None = None
    text_start = 0
    for tag in _TAG.finditer(response):
        is_close, name = tag.group(1) == "/", tag.group(2)
        if open_name is None:
            if is_close or response[text_start:tag.start()].strip():
                return False
            open_name = name
        else:
            if not is_close or name != open_name:
                return False
            blocks.append(name)
            open_name = None
        text_start = tag.end()
    if open_name is not None or response[text_start:].strip():
        return False
    return _VALID_BLOCK_SEQUENCE.fullmatch(" ".join(blocks)) is not None


def retrieval_found_answer(response: str, answers: list[str]) -> bool:
    """Whether some normalised golden answer occurs inside the normalised text of one
    <information> block. Golden answers that normalise to "" are ignored: the empty
    string is a substring of everything."""
    normalized_answers = [a for a in (normalize_answer(answer) for answer in answers) if a]
    for block in _INFORMATION_BLOCK.finditer(response):
        information = normalize_answer(block.group(1))
        if any(answer in information for answer in normalized_answers):
            return True
    return False


@register_scorer("search_r1_format", options=("structure_format_score", "final_format_score", "retrieval_score"))
def search_r1_format_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    structure_format_score: float = 0.0,
    final_format_score: float = 0.0,
    retrieval_score: float = 0.0,
) -> dict:
    """Format-aware exact match (Search-R1 v0.3).

    answer correct               → 1.0 with a valid format, else 1.0 − structure_format_score
    wrong or no answer, valid    → structure_format_score (+ retrieval_score when an
                                   <information> block contains a golden answer)
    wrong answer, invalid format → final_format_score
    no answer, invalid format    → 0.0
    """
    answers = golden_answers(ground_truth)
    answer = extract_answer(solution_str)
    valid = is_valid_search_r1_format(solution_str)
    correct = answer is not None and exact_match(answer, answers)
    retrieval_correct = retrieval_found_answer(solution_str, answers)
    if correct:
        score = 1.0 if valid else 1.0 - structure_format_score
    elif valid:
        score = structure_format_score + (retrieval_score if retrieval_correct else 0.0)
    elif answer is not None:
        score = final_format_score
    else:
        score = 0.0
    return {
        "score": score,
        "acc": correct,
        "pred": answer,
        "valid_format": valid,
        "retrieval_correct": retrieval_correct,
    }

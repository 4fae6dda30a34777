"""The scoring of one sample from the reward settings (`RewardConfig`).

Main entry points: `score_one(cfg, request)` (one sample) and `apply_group_rewards` (the
components that compare the responses of one prompt, applied once all are scored).
The reward is Σ weight · component over `cfg.effective_weights()` (see megarl.reward.settings).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from megarl.reward.math_verify_reward import math_verify_accuracy, open_r1_length_correct
from megarl.reward.open_r1 import (
    cosine_scaled_reward,
    format_reward,
    len_rewards,
    reasoning_steps_reward,
    repetition_penalty_reward,
    tag_count_reward,
)
from megarl.reward.registry import SCORERS, custom_functions, load_custom_function, score_task, scorer_for_data_source
from megarl.reward.settings import (
    COMPONENT_NAMES, GROUP_COMPONENTS, NEED_CORRECTNESS, RewardConfig, unknown_weight_names,
)

__all__ = ["COMPONENT_NAMES", "RewardRequest", "RewardResult", "apply_group_rewards", "combine_rewards", "score_one"]


@dataclass(frozen=True)
class RewardRequest:
    """One sample to score. solution_str is the decoded response only, not the prompt (its last
    characters only where scoring reads no more: `characters_read`)."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict | None = None
    group_id: Hashable | None = None
    """Prompt group (uid) for group-level components; None = a group of its own."""
    response_length: int | None = None
    """Response length in tokens; length components fall back to characters without it."""


@dataclass(frozen=True)
class RewardResult:
    score: float
    acc: bool
    pred: str | None = None
    components: dict[str, float | None] = field(default_factory=dict)
    """Component values; None = skipped (left out of the weighted sum)."""
    error: str | None = None
    """Why scoring failed (score is then 0.0); None on success."""
    timed_out: bool = False


def failed_result(error: str, timed_out: bool = False) -> RewardResult:
    """A reward that could not be computed scores 0 and is not correct."""
    return RewardResult(score=0.0, acc=False, error=error, timed_out=timed_out)


def check_weight_names(weights: Mapping[str, float]) -> None:
    error = unknown_weight_names(weights)
    if error:
        raise ValueError(error)


def combine_rewards(components: Mapping[str, float | None], weights: Mapping[str, float]) -> float:
    """Σ weights[name] · components[name] over the weighted components; a component that
    is None or absent (skipped for this sample) is left out of the sum."""
    check_weight_names(weights)
    return float(sum(weight * components[name] for name, weight in weights.items() if components.get(name) is not None))


def response_length(cfg: RewardConfig, request: RewardRequest) -> int:
    """The length the length rewards grade: characters as open-r1 counts them, or tokens
    (reward.length_rewards=megarl) when the trainer gave them."""
    if cfg.length_rewards == "megarl" and request.response_length is not None:
        return request.response_length
    return len(request.solution_str)


def length_correctness(cfg: RewardConfig, request: RewardRequest, components: Mapping[str, float | None],
                       task_acc: bool | None) -> bool | None:
    """The correctness len and cosine_scaled grade length against: open-r1's own check
    (math_verify_reward.open_r1_length_correct), or megarl's, the accuracy component or the task's
    acc (reward.length_rewards=megarl); None when unknown (a gold that does not parse)."""
    if cfg.length_rewards == "open_r1":
        return open_r1_length_correct(request.solution_str, request.ground_truth)
    return _correctness(components, task_acc)


def _correctness(components: Mapping[str, float | None], task_acc: bool | None) -> bool | None:
    """Correctness for the length components: math-verify accuracy when computed (None
    when its gold did not parse), else the task's acc."""
    if "accuracy" in components:
        accuracy = components["accuracy"]
        return None if accuracy is None else accuracy > 0
    return task_acc


def characters_read(cfg: RewardConfig, data_source: str) -> int | None:
    """How many of a response's last characters scoring a sample of `data_source` reads, or
    None for all of it: a number only when the task score is the whole reward and its scorer
    (routed, or named by reward.custom_function) declares one (Scorer.last_chars)."""
    if set(cfg.effective_weights()) != {"task_score"}:
        return None
    named = cfg.scorer_for(data_source)
    if named is not None:
        return SCORERS[named].last_chars if named in SCORERS else None
    try:
        return scorer_for_data_source(data_source).last_chars
    except ValueError:  # scoring names the unknown data source
        return None


def score_one(cfg: RewardConfig, request: RewardRequest) -> RewardResult:
    """The reward of one sample, without group-level components (see apply_group_rewards).
    Raises on a broken reward function; the pool turns that into a counted error."""
    weights = cfg.effective_weights()
    components: dict[str, float | None] = {}
    task: dict | None = None
    if "task_score" in weights:
        task = score_task(
            cfg.scorer_for(request.data_source), request.data_source, request.solution_str, request.ground_truth,
            request.extra_info, cfg.scorer_options(),
        )
        components["task_score"] = task["score"]
    if "accuracy" in weights:
        components["accuracy"] = math_verify_accuracy(request.solution_str, request.ground_truth, cfg.math_verify_gold)
    task_acc = task["acc"] if task else None
    correct = _correctness(components, task_acc)
    text = request.solution_str
    if "format" in weights:
        components["format"] = format_reward(text, strict_end=cfg.format_strict_end)
    if "tag_count" in weights:
        components["tag_count"] = tag_count_reward(text)
    if "reasoning_steps" in weights:
        components["reasoning_steps"] = reasoning_steps_reward(text)
    if "repetition_penalty" in weights:
        components["repetition_penalty"] = repetition_penalty_reward(
            text, cfg.repetition_ngram_size, cfg.repetition_max_penalty
        )
    if "cosine_scaled" in weights:
        graded = length_correctness(cfg, request, components, task_acc)
        components["cosine_scaled"] = 1.0 if graded is None and cfg.length_rewards == "open_r1" else (
            cosine_scaled_reward(
                response_length(cfg, request), graded, cfg.cosine_max_len,
                cfg.cosine_min_value_wrong, cfg.cosine_max_value_wrong,
                cfg.cosine_min_value_correct, cfg.cosine_max_value_correct, clamp=cfg.length_rewards == "megarl",
            ))
    return RewardResult(
        score=combine_rewards(components, weights),
        acc=bool(correct),  # unknown correctness counts as not correct
        pred=task.get("pred") if task else None,
        components=components,
    )


def apply_group_rewards(
    cfg: RewardConfig, requests: list[RewardRequest], results: list[RewardResult]
) -> list[RewardResult]:
    """Add the group-level components (len) to scored results, grouping by group_id,
    and recombine their scores. Failed results keep score 0 and take no part: their
    correctness is unknown."""
    weights = cfg.effective_weights()
    if not set(GROUP_COMPONENTS) & set(weights):
        return results
    groups: dict[Any, list[int]] = defaultdict(list)
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        if result.error is None:
            # a request without a group id is a group of its own
            groups[request.group_id if request.group_id is not None else object()].append(index)
    updated = list(results)
    for indices in groups.values():
        lengths = [response_length(cfg, requests[i]) for i in indices]
        correct = [length_correctness(cfg, requests[i], results[i].components, results[i].acc) for i in indices]
        if cfg.length_rewards == "open_r1":  # open-r1 counts a response whose gold does not parse as correct
            correct = [True if c is None else c for c in correct]
        for index, value in zip(indices, len_rewards(lengths, correct)):
            components = {**results[index].components, "len": value}
            updated[index] = replace(results[index], components=components, score=combine_rewards(components, weights))
    return updated


def warm_up(cfg: RewardConfig) -> None:
    """Import what scoring with these settings will need (custom function, math-verify), so
    that a worker's first call does not spend its time limit on imports, and a bad
    custom_function fails here, at start-up, with its own message."""
    for key, name in custom_functions(cfg):
        load_custom_function(name, key)
    weights = cfg.effective_weights()
    if "accuracy" in weights:
        math_verify_accuracy("\\boxed{1}", "1")
    if cfg.length_rewards == "open_r1" and set(NEED_CORRECTNESS) & set(weights):
        open_r1_length_correct("\\boxed{1}", "$1$")

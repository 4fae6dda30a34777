"""Reward settings as data, and the scoring of one sample from them.

Main entry points: `RewardSpec` (what to compute; picklable, so reward workers receive
it once), `score_one(spec, request)` (one sample) and `apply_group_rewards` (the
components that compare the responses of one prompt, applied once all are scored).

Two modes, one code path: with empty `weights` the reward is the task score alone
(custom_function, or the scorer routed by data_source), i.e. weights {"task_score": 1};
otherwise it is Σ weight · component over the named components.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from megarl.reward.math_verify_reward import math_verify_accuracy
from megarl.reward.open_r1 import (
    cosine_scaled_reward,
    format_reward,
    len_rewards,
    reasoning_steps_reward,
    repetition_penalty_reward,
    soft_overlong_reward,
    tag_count_reward,
)
from megarl.reward.registry import SCORER_OPTION_NAMES, SCORERS, load_custom_function, score_task

# Components scored one sample at a time, then the ones that need the whole group.
SAMPLE_COMPONENTS = (
    "task_score", "accuracy", "format", "tag_count", "reasoning_steps",
    "cosine_scaled", "repetition_penalty", "soft_overlong",
)
GROUP_COMPONENTS = ("len",)
COMPONENT_NAMES = SAMPLE_COMPONENTS + GROUP_COMPONENTS
# Components that grade length against correctness, so need a source of correctness.
_NEED_CORRECTNESS = ("cosine_scaled", "len")


@dataclass(frozen=True)
class RewardSpec:
    """What reward to compute. Field names match the reward section of the run config."""

    custom_function: str | None = None
    """A built-in scorer name (search_r1_em, search_r1_format, dapo_math) or
    'module.path:function' (fn(data_source, solution_str, ground_truth, extra_info) ->
    float | dict) used instead of routing by data_source."""
    weights: dict[str, float] = field(default_factory=dict)
    """Component name → weight; the reward is Σ weight · component. Empty = task score only.
    Names: see COMPONENT_NAMES; "task_score" is the routed/custom score. Weight 0 computes
    a component (e.g. accuracy, as the correctness used by len/cosine_scaled) without adding it."""
    format_score: float = 0.0
    """Search-R1 EM: score of a response whose answer is wrong."""
    structure_format_score: float = 0.0
    """search_r1_format: credit for a valid tag structure (subtracted from a correct answer in a bad structure)."""
    final_format_score: float = 0.0
    """search_r1_format: score of a wrong answer in an invalid structure."""
    retrieval_score: float = 0.0
    """search_r1_format: bonus when retrieval surfaced a golden answer (valid structure, wrong answer)."""
    repetition_ngram_size: int = 3
    """repetition_penalty: n-gram size in words."""
    repetition_max_penalty: float = -1.0
    """repetition_penalty: penalty (<= 0) when every n-gram is a repeat."""
    cosine_max_len: int = 1000
    """cosine_scaled: length (tokens, or characters without response_length) where the cosine ends."""
    cosine_min_value_wrong: float = -1.0
    cosine_max_value_wrong: float = -0.5
    cosine_min_value_correct: float = 0.5
    cosine_max_value_correct: float = 1.0
    overlong_max_response_length: int | None = None
    """soft_overlong: maximum response length in tokens (rollout.max_response_length)."""
    overlong_buffer_len: int = 4096
    """soft_overlong: tokens before the maximum where the penalty ramps from 0 to −penalty_factor."""
    overlong_penalty_factor: float = 1.0
    """soft_overlong: penalty at the maximum length."""

    def __post_init__(self) -> None:
        check_weight_names(self.weights)
        for name, weight in self.weights.items():
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"reward weight {name}={weight!r} must be a finite number")
        if self.custom_function is not None and self.custom_function not in SCORERS and ":" not in self.custom_function:
            raise ValueError(
                f"reward custom_function {self.custom_function!r} is neither a built-in scorer {sorted(SCORERS)} "
                "nor an import string 'module.path:function'"
            )
        if self.custom_function is not None and self.weights and "task_score" not in self.weights:
            raise ValueError(
                f"reward custom_function {self.custom_function!r} is never called: with weights it is the "
                "'task_score' component; add task_score to the weights or unset custom_function"
            )
        if self.repetition_max_penalty > 0:
            raise ValueError(f"repetition_max_penalty={self.repetition_max_penalty} must be <= 0: it is a penalty")
        if self.repetition_ngram_size < 1:
            raise ValueError(f"repetition_ngram_size={self.repetition_ngram_size} must be >= 1")
        if self.cosine_max_len <= 0:
            raise ValueError(f"cosine_max_len={self.cosine_max_len} must be > 0")
        if "soft_overlong" in self.weights:
            if self.overlong_max_response_length is None:
                raise ValueError("reward weight soft_overlong needs overlong_max_response_length (rollout.max_response_length)")
            if not 0 < self.overlong_buffer_len < self.overlong_max_response_length:
                raise ValueError(
                    f"overlong_buffer_len={self.overlong_buffer_len} must be in (0, overlong_max_response_length="
                    f"{self.overlong_max_response_length})"
                )
        needing = [name for name in _NEED_CORRECTNESS if name in self.weights]
        if needing and not {"accuracy", "task_score"} & set(self.weights):
            raise ValueError(
                f"reward weights {needing} grade length against correctness but nothing measures correctness; "
                "add 'accuracy' (math-verify) or 'task_score' to the weights (weight 0 computes it without adding it)"
            )

    def effective_weights(self) -> dict[str, float]:
        return dict(self.weights) if self.weights else {"task_score": 1.0}

    def scorer_options(self) -> dict[str, Any]:
        """The settings the named scorers take (format_score, …), by name."""
        return {name: getattr(self, name) for name in SCORER_OPTION_NAMES}


@dataclass(frozen=True)
class RewardRequest:
    """One sample to score. solution_str is the decoded response only, not the prompt."""

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
    unknown = sorted(set(weights) - set(COMPONENT_NAMES))
    if unknown:
        raise ValueError(f"unknown reward weight names {unknown}; valid names are {list(COMPONENT_NAMES)}")


def combine_rewards(components: Mapping[str, float | None], weights: Mapping[str, float]) -> float:
    """Σ weights[name] · components[name] over the weighted components; a component that
    is None or absent (skipped for this sample) is left out of the sum."""
    check_weight_names(weights)
    return float(sum(weight * components[name] for name, weight in weights.items() if components.get(name) is not None))


def response_length(request: RewardRequest) -> int:
    return request.response_length if request.response_length is not None else len(request.solution_str)


def _correctness(components: Mapping[str, float | None], task_acc: bool | None) -> bool | None:
    """Correctness for the length components: math-verify accuracy when computed (None
    when its gold did not parse), else the task's acc."""
    if "accuracy" in components:
        accuracy = components["accuracy"]
        return None if accuracy is None else accuracy > 0
    return task_acc


def _soft_overlong(spec: RewardSpec, request: RewardRequest) -> float:
    if request.response_length is None:
        raise ValueError("reward soft_overlong needs RewardRequest.response_length (tokens); the request has none")
    return soft_overlong_reward(
        request.response_length, spec.overlong_max_response_length, spec.overlong_buffer_len, spec.overlong_penalty_factor
    )


def score_one(spec: RewardSpec, request: RewardRequest) -> RewardResult:
    """The reward of one sample, without group-level components (see apply_group_rewards).
    Raises on a broken reward function; the pool turns that into a counted error."""
    weights = spec.effective_weights()
    components: dict[str, float | None] = {}
    task: dict | None = None
    if "task_score" in weights:
        task = score_task(
            spec.custom_function, request.data_source, request.solution_str, request.ground_truth,
            request.extra_info, spec.scorer_options(),
        )
        components["task_score"] = task["score"]
    if "accuracy" in weights:
        components["accuracy"] = math_verify_accuracy(request.solution_str, request.ground_truth)
    correct = _correctness(components, task["acc"] if task else None)
    text = request.solution_str
    if "format" in weights:
        components["format"] = format_reward(text)
    if "tag_count" in weights:
        components["tag_count"] = tag_count_reward(text)
    if "reasoning_steps" in weights:
        components["reasoning_steps"] = reasoning_steps_reward(text)
    if "repetition_penalty" in weights:
        components["repetition_penalty"] = repetition_penalty_reward(
            text, spec.repetition_ngram_size, spec.repetition_max_penalty
        )
    if "cosine_scaled" in weights:
        components["cosine_scaled"] = cosine_scaled_reward(
            response_length(request), correct, spec.cosine_max_len,
            spec.cosine_min_value_wrong, spec.cosine_max_value_wrong,
            spec.cosine_min_value_correct, spec.cosine_max_value_correct,
        )
    if "soft_overlong" in weights:
        components["soft_overlong"] = _soft_overlong(spec, request)
    return RewardResult(
        score=combine_rewards(components, weights),
        acc=bool(correct),  # unknown correctness counts as not correct
        pred=task.get("pred") if task else None,
        components=components,
    )


def apply_group_rewards(
    spec: RewardSpec, requests: list[RewardRequest], results: list[RewardResult]
) -> list[RewardResult]:
    """Add the group-level components (len) to scored results, grouping by group_id,
    and recombine their scores. Failed results keep score 0 and take no part: their
    correctness is unknown."""
    weights = spec.effective_weights()
    if not set(GROUP_COMPONENTS) & set(weights):
        return results
    groups: dict[Any, list[int]] = defaultdict(list)
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        if result.error is None:
            # a request without a group id is a group of its own
            groups[request.group_id if request.group_id is not None else object()].append(index)
    updated = list(results)
    for indices in groups.values():
        lengths = [response_length(requests[i]) for i in indices]
        correct = [_correctness(results[i].components, results[i].acc) for i in indices]
        for index, value in zip(indices, len_rewards(lengths, correct)):
            components = {**results[index].components, "len": value}
            updated[index] = replace(results[index], components=components, score=combine_rewards(components, weights))
    return updated


def warm_up(spec: RewardSpec) -> None:
    """Import what scoring with this spec will need (custom function, math-verify, torch
    for soft_overlong), so that a worker's first call does not spend its time limit on
    imports, and a bad custom_function fails here, at start-up, with its own message."""
    if spec.custom_function is not None and spec.custom_function not in SCORERS:
        load_custom_function(spec.custom_function)
    weights = spec.effective_weights()
    if "accuracy" in weights:
        math_verify_accuracy("\\boxed{1}", "1")
    if "soft_overlong" in weights:
        soft_overlong_reward(0, 2, 1)

"""The reward settings of a run: the `reward:` section of the run config, and their checks.

`RewardConfig` is both that section (megarl.config's RunConfig.reward) and what the reward
code takes (score_one, apply_group_rewards, warm_up, RewardPool); it is picklable, so
reward workers receive it once. `check_reward_config` is the one set of rules for it: the
run config reports its problems with the rest of the config, a RewardConfig built in code
raises them as a ValueError (ConfigError).

Two modes, one code path: with empty `weights` the reward is the task score alone
(custom_function, or the scorer routed by data_source), i.e. weights {"task_score": 1};
otherwise it is Σ weight · component over the named components.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from megarl.config_loader import Problems, check_ranges, param
from megarl.reward.dapo_math import DapoMathNormalization
from megarl.reward.math_verify_reward import MathVerifyGold
from megarl.reward.open_r1 import LengthRewards
from megarl.reward.registry import SCORER_OPTION_NAMES, SCORERS

# Components scored one sample at a time, then the ones that need the whole group.
SAMPLE_COMPONENTS = (
    "task_score", "accuracy", "format", "tag_count", "reasoning_steps", "cosine_scaled", "repetition_penalty",
)
GROUP_COMPONENTS = ("len",)
COMPONENT_NAMES = SAMPLE_COMPONENTS + GROUP_COMPONENTS
# Components that grade length against correctness: open-r1's judge it themselves, megarl's
# (reward.length_rewards=megarl) take it from accuracy or the task score.
NEED_CORRECTNESS = ("cosine_scaled", "len")
# The overlong penalty is applied once, after the reward, by algorithm.overlong
# (megarl.experience.shape_overlong); a reward component for it would count it twice.
_OVERLONG_COMPONENT = "soft_overlong"


@dataclass
class RewardConfig:
    """What reward to compute and how the reward workers run."""

    custom_function: str | None = param(
        None, "Scorer used instead of routing by data_source: a built-in name (search_r1_em, search_r1_format, "
        "dapo_math, code, code_binary, ioi, code_format) or 'module.path:function' (fn(data_source, solution_str, ground_truth, extra_info) -> "
        "float | dict).")
    data_sources: dict[str, str] = param(
        help="data_source -> the scorer of its rows, a built-in name or 'module.path:function' (as custom_function "
        "takes them), before the built-in routes: a new data set without an edit of megarl/reward/registry.py, e.g. "
        "{my_math: dapo_math, my_qa: my_pkg.rewards:score}. Unused when custom_function scores every row.",
        factory=dict)
    weights: dict[str, float] = param(
        help="Component name -> weight; the reward is Σ weight · component. Empty = the task score alone "
        "(custom_function, or the scorer routed by data_source). Names: task_score (that score), accuracy "
        "(math-verify), format, tag_count, reasoning_steps, cosine_scaled, repetition_penalty, len. Weight 0 "
        "computes a component (e.g. accuracy, the correctness len and cosine_scaled grade by) without adding it.",
        factory=dict,
    )
    format_score: float = param(0.0, "Search-R1 EM: score of a well-formed response whose answer is wrong.")
    structure_format_score: float = param(
        0.0, "search_r1_format: credit for a valid think/search/answer structure (subtracted from a correct "
        "answer in a bad structure).")
    final_format_score: float = param(0.0, "search_r1_format: score of a wrong answer in an invalid structure.")
    retrieval_score: float = param(
        0.0, "search_r1_format: bonus when retrieval surfaced a golden answer (valid structure, wrong answer).")
    dapo_math_normalization: DapoMathNormalization = param(
        "verl", "dapo_math: how answers are normalised before they are compared. verl = verl's math_dapo "
        "answer for answer (DAPO's reward: '628.' is not '628', '3, 4' is '34'); lenient = megarl's, which also "
        "accepts '628.', '\\dfrac{3}{4}' for '\\frac{3}{4}' and keeps lists as lists (its scores are not DAPO's).")
    math_verify_gold: MathVerifyGold = param(
        "open_r1", "accuracy: how the gold answer is read. open_r1 = as open-r1's accuracy_reward reads it "
        "(math-verify's default extraction: a bare '2\\pi' reads as 2, a bare '\\sqrt{2}' as nothing, so the "
        "sample is skipped); formula = megarl's, for data sets of bare answers: a bare formula is read whole "
        "(inside $...$), a gold that reads as text is skipped (its scores are not open-r1's).")
    length_rewards: LengthRewards = param(
        "open_r1", "len and cosine_scaled: open_r1 = as open-r1 computes them (their own correctness check, the "
        "gold read as LaTeX only; lengths in characters; a response whose gold does not parse counted correct by "
        "len, 1.0 from cosine_scaled; the cosine followed past cosine_max_len); megarl = correctness from accuracy "
        "or task_score, lengths in tokens (the generation cost), such a response skipped, cosine_scaled held at its "
        "end value past cosine_max_len (its scores are not open-r1's).")
    code_sandbox_url: str | None = param(
        None, "code, code_binary, ioi: where programs run. None = a bubblewrap sandbox on this machine (the "
        "README's rewards section); a URL = a sandbox service (`megarl sandbox serve`), its key from $MEGARL_SANDBOX_API_KEY.")
    sandbox_servers: int = param(
        0, "code rewards under cluster.launcher=ray: sandbox services (`megarl sandbox serve`) megarl starts as Ray "
        "actors, spread over the cluster's nodes with a CPU each, which the reward workers then use (0: each reward "
        "worker runs its sandboxes on its own node).", ge=0)
    code_wall_s: float = param(5.0, "code rewards: wall-time limit of one test case (CPU time: as many seconds).", gt=0)
    code_memory_mb: int = param(512, "code rewards: address-space limit of each process of a test case, in MiB.", gt=0)
    format_strict_end: bool = param(
        False, "format: false = open-r1's check, which ends at '</answer>' followed by the end or a newline (what "
        "follows that newline is not read); true = nothing but one newline may follow '</answer>'.")
    repetition_ngram_size: int = param(3, "repetition_penalty: n-gram size in words.", gt=0)
    repetition_max_penalty: float = param(
        -1.0, "repetition_penalty: reward (<= 0) of a response whose every n-gram is a repeat.", le=0.0)
    cosine_max_len: int = param(
        1000, "cosine_scaled: length where the cosine schedule ends, in characters (reward.length_rewards=open_r1) "
        "or tokens (megarl; characters when the response length in tokens is unknown).", gt=0)
    cosine_min_value_wrong: float = param(-1.0, "cosine_scaled: reward of a wrong answer at length 0.")
    cosine_max_value_wrong: float = param(-0.5, "cosine_scaled: reward of a wrong answer at cosine_max_len.")
    cosine_min_value_correct: float = param(0.5, "cosine_scaled: reward of a correct answer at cosine_max_len.")
    cosine_max_value_correct: float = param(1.0, "cosine_scaled: reward of a correct answer at length 0.")
    timeout_s: float = param(10.0, "Time limit of one reward call in seconds; a timeout scores 0 and is counted.",
                             gt=0.0)
    num_workers: int = param(
        0, "Reward processes; 0 = in the trainer process (best for cheap rule rewards; use workers for "
        "math-verify or slow custom functions).", ge=0)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError (a ValueError) listing every problem of these settings."""
        problems = Problems()
        check_reward_config(self, problems)
        problems.raise_if_any()

    def effective_weights(self) -> dict[str, float]:
        return dict(self.weights) if self.weights else {"task_score": 1.0}

    def scorer_for(self, data_source: str) -> str | None:
        """The scorer named for `data_source` (custom_function, else data_sources), or None:
        the built-in routes pick it."""
        return self.custom_function if self.custom_function is not None else self.data_sources.get(data_source)

    def scorer_options(self) -> dict[str, Any]:
        """The settings the named scorers take (format_score, …), by name."""
        return {name: getattr(self, name) for name in SCORER_OPTION_NAMES}


def unknown_weight_names(weights: Mapping[str, float]) -> str | None:
    """What is wrong with the names of `weights`, or None when every name is a component."""
    unknown = sorted(set(weights) - set(COMPONENT_NAMES))
    if unknown:
        return f"unknown reward weight names {unknown}; valid names are {list(COMPONENT_NAMES)}"
    return None


def check_reward_config(cfg: RewardConfig, problems: Problems, prefix: str = "reward.") -> None:
    """Add every problem of `cfg` to `problems`, keyed `prefix` + field name, with its fix."""
    check_ranges(cfg, prefix, problems)
    weights = cfg.weights
    if _OVERLONG_COMPONENT in weights:
        problems.add(f"{prefix}weights", f"names {_OVERLONG_COMPONENT}, but the overlong penalty is "
                     "algorithm.overlong (DAPO's soft overlong punishment, applied once, after the reward)",
                     f"remove {_OVERLONG_COMPONENT} from {prefix}weights and set algorithm.overlong.enable=true "
                     "(buffer_len, penalty_factor)")
    unknown = unknown_weight_names({k: v for k, v in weights.items() if k != _OVERLONG_COMPONENT})
    if unknown:
        problems.add(f"{prefix}weights", unknown, "use the valid names")
    for name, weight in weights.items():
        if not isinstance(weight, (int, float)) or not math.isfinite(weight):
            problems.add(f"{prefix}weights.{name}", f"{weight!r} must be a finite number", "give a finite number")
    for name, choices, what in (("dapo_math_normalization", DapoMathNormalization, "a normalisation"),
                                ("math_verify_gold", MathVerifyGold, "a reading of the gold answer"),
                                ("length_rewards", LengthRewards, "a way of computing the length rewards")):
        if getattr(cfg, name) not in get_args(choices):
            problems.add(f"{prefix}{name}", f"{getattr(cfg, name)!r} is not {what}",
                         f"use one of {list(get_args(choices))}")
    custom = cfg.custom_function
    named = [("custom_function", custom)] + [(f"data_sources.{k}", v) for k, v in cfg.data_sources.items()]
    for key, name in named:
        if name is not None and name not in SCORERS and ":" not in name:
            problems.add(f"{prefix}{key}", f"{name!r} is neither a built-in scorer {sorted(SCORERS)} "
                         "nor an import string 'module.path:function'",
                         f"use one of {sorted(SCORERS)} or 'module.path:function'")
    if custom is not None and cfg.data_sources:
        problems.add(f"{prefix}data_sources", f"{sorted(cfg.data_sources)} are never consulted: "
                     f"{prefix}custom_function={custom!r} scores every row", "unset one of the two")
    if custom is not None and weights and "task_score" not in weights:
        problems.add(f"{prefix}custom_function", f"{custom!r} is never called: with {prefix}weights it is the "
                     "'task_score' component", f"add task_score to {prefix}weights or unset {prefix}custom_function")
    needing = [name for name in NEED_CORRECTNESS if name in weights]
    if needing and cfg.length_rewards == "megarl" and not {"accuracy", "task_score"} & set(weights):
        problems.add(f"{prefix}weights", f"{needing} grade length against correctness but nothing measures "
                     "correctness", f"add 'accuracy' (math-verify) or 'task_score' to {prefix}weights (weight 0 "
                     "computes it without adding it)")

"""Which scoring function grades a sample: the routes from data_source to a named scorer and
the named scorers (megarl.reward.scorers, filled by @register_scorer in the scorers' own
modules, imported here), and custom functions loaded from "module.path:function".

Main entry point: `compute_score(data_source, solution_str, ground_truth, extra_info)`.

Custom scoring is plugged through the import string (reward.custom_function), not by
adding to these tables at run time: reward workers are fresh processes that import this
module anew and would not see such additions, while an import string works everywhere.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from megarl.import_string import check_call, import_function
from megarl.reward import code, dapo_math, search_r1
from megarl.reward.scorers import ROUTES, SCORERS, Route, Scorer, register_scorer

# importing them registered their scorers (@register_scorer); their routes are consulted (and
# listed in messages) in this order, whichever module was imported first
BUILT_IN_SCORER_MODULES = (search_r1, dapo_math, code)
_ORDER = [m.__name__ for m in BUILT_IN_SCORER_MODULES]
ROUTES.sort(key=lambda route: _ORDER.index(SCORERS[route.scorer].fn.__module__))  # in place: stable

__all__ = ["ROUTES", "SCORERS", "Route", "Scorer", "register_scorer", "compute_score", "score_task",
           "load_custom_function", "scorer_for_data_source", "describe_routes"]

CUSTOM_SIGNATURE = "fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"
CUSTOM_FUNCTION_FORM = f"'module.path:function' with signature {CUSTOM_SIGNATURE}"


SCORER_OPTION_NAMES = tuple(sorted({option for scorer in SCORERS.values() for option in scorer.options}))


def describe_routes() -> str:
    """One line per route, for error messages: 'nq, popqa, search* → search_r1_em'."""
    return "; ".join(
        ", ".join([*sorted(route.names), *(prefix + "*" for prefix in route.prefixes)]) + " → " + route.scorer
        for route in ROUTES
    )


def _routed(data_source: str) -> str | None:
    """The scorer's name a built-in route gives data_source, or None."""
    return next((route.scorer for route in ROUTES if route.matches(data_source)), None)


def _routing_help(data_source: str) -> str:
    return (f"Known data sources: {describe_routes()}. For another data set name its scorer in reward.data_sources "
            f"({{{data_source}: SCORER}}) or set reward.custom_function (every row); a scorer is "
            f"{CUSTOM_FUNCTION_FORM} or one of the built-in scorers {sorted(SCORERS)}.")


def scorer_for_data_source(data_source: str) -> Scorer:
    """The scorer routed to data_source; ValueError naming it when there is none."""
    name = _routed(data_source)
    if name is None:
        raise ValueError(f"no reward function for data_source {data_source!r}. {_routing_help(data_source)}")
    return SCORERS[name]


def check_data_sources(settings, counts: dict[str, int]) -> None:
    """ValueError naming each data source of the data (`counts`: rows of each) that no reward
    scores: neither reward.custom_function, reward.data_sources nor a built-in route. Its rows
    would all score 0, and a run of them would learn nothing yet end as finished."""
    unknown = sorted(s for s in counts if settings.scorer_for(s) is None and _routed(s) is None)
    if unknown:
        listed = ", ".join(f"{s!r} ({counts[s]} rows)" for s in unknown)
        raise ValueError(f"no reward scores data_source {listed}: every such row would score 0. "
                         f"{_routing_help(unknown[0])}")


def run_scorer(
    scorer: Scorer, solution_str: str, ground_truth: Any, extra_info: dict | None, options: Mapping[str, Any]
) -> dict:
    """Call a scorer with the options it takes, picked from `options` (others ignored)."""
    kwargs = {name: options[name] for name in scorer.options if name in options}
    return scorer.fn(solution_str, ground_truth, extra_info, **kwargs)


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **options: Any
) -> dict:
    """Score one response (the response only, not the prompt) with the scorer routed to
    its data_source. Returns a dict with at least "score" (float) and "acc" (bool).

    options: reward settings such as format_score, passed to the scorers that take them.
    """
    unknown = sorted(set(options) - set(SCORER_OPTION_NAMES))
    if unknown:
        raise TypeError(f"compute_score got unknown options {unknown}; the scorers take {list(SCORER_OPTION_NAMES)}")
    return run_scorer(scorer_for_data_source(data_source), solution_str, ground_truth, extra_info, options)


@cache
def load_custom_function(import_string: str, key: str = "reward.custom_function") -> Callable[..., Any]:
    """The function named by "module.path:function" (the part after ':' may be dotted, e.g.
    "pkg.rewards:Grader.score"), checked to take the call score_task makes (four positional
    arguments): one written for another signature would otherwise fail on every sample, each
    failure counted as a zero score while training goes on. ValueError naming the setting `key`,
    the string and what went wrong."""
    fn = import_function(import_string, key, CUSTOM_FUNCTION_FORM, names=f"a built-in scorer {sorted(SCORERS)}")
    check_call(fn, f"{key} {import_string!r}", CUSTOM_SIGNATURE, "data_source", "solution_str", "ground_truth", None)
    return fn


def custom_functions(cfg: Any, prefix: str = "reward.") -> list[tuple[str, str]]:
    """(setting, import string) of each function a RewardConfig names by import string:
    custom_function and the data_sources' values that are not built-in scorers."""
    named = [(f"{prefix}custom_function", cfg.custom_function)]
    named += [(f"{prefix}data_sources.{source}", name) for source, name in cfg.data_sources.items()]
    return [(key, name) for key, name in named if name is not None and name not in SCORERS and ":" in name]


def check_reward_functions(cfg: Any, problems: Any, prefix: str = "reward.") -> None:
    """Import each function the reward settings `cfg` name and bind its signature, as the reward
    workers' start does: a missing module or a function of another call is a config error when the
    config is read (and in `megarl train --dry-run`), not a failure after the model has loaded.
    Strings of the wrong form are check_reward_config's."""
    for key, name in custom_functions(cfg, prefix):
        try:
            load_custom_function(name, key)
        except ValueError as error:
            problems.add(key, str(error), f"name an importable function called as {CUSTOM_SIGNATURE}, or a "
                         f"built-in scorer {sorted(SCORERS)}")


def as_score_dict(value: Any, source: str) -> dict:
    """A custom function's return value as a score dict. A number becomes
    {"score": value, "acc": value > 0}; a dict needs "score" and gets "acc" = score > 0
    when it does not say."""
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"reward function {source!r} returned a dict without 'score' (keys: {sorted(value)})")
        score = float(value["score"])
        return {**value, "score": score, "acc": bool(value.get("acc", score > 0))}
    if isinstance(value, numbers.Real):  # also numpy scalars
        return {"score": float(value), "acc": bool(value > 0), "pred": None}
    raise TypeError(f"reward function {source!r} returned {type(value).__name__}; return a float or a dict with 'score'")


def score_task(
    custom_function: str | None,
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None,
    options: Mapping[str, Any],
) -> dict:
    """The task score of one sample: routed by data_source when custom_function is None,
    else by the built-in scorer of that name or the imported "module.path:function"."""
    if custom_function is None:
        scorer = scorer_for_data_source(data_source)
        return run_scorer(scorer, solution_str, ground_truth, extra_info, options)
    if custom_function in SCORERS:
        return run_scorer(SCORERS[custom_function], solution_str, ground_truth, extra_info, options)
    fn = load_custom_function(custom_function)
    return as_score_dict(fn(data_source, solution_str, ground_truth, extra_info), custom_function)

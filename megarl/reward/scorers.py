"""The table of megarl's built-in scorers and the data_source routes to them, filled by
`@register_scorer` where each scorer is written (megarl.reward.search_r1, dapo_math, code):
a scorer inside megarl is one decorated function, its module imported by
megarl.reward.registry. A scorer outside megarl needs no registration: reward.custom_function
or reward.data_sources names it by its import string. Main entry point: `register_scorer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Scorer:
    """A scoring function fn(solution_str, ground_truth, extra_info, **options) -> dict
    with at least "score" (float) and "acc" (bool); `options` names the reward settings
    (RewardConfig fields of the same name) it takes as keyword arguments; `last_chars`, when
    set, is all of a response it reads: its last characters (the trainer then decodes no more)."""

    fn: Callable[..., dict]
    options: tuple[str, ...] = ()
    last_chars: int | None = None


@dataclass(frozen=True)
class Route:
    """data_source values (exact names, or prefixes) graded by the scorer `scorer`."""

    scorer: str
    names: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()

    def matches(self, data_source: str) -> bool:
        return data_source in self.names or data_source.startswith(self.prefixes)


SCORERS: dict[str, Scorer] = {}
ROUTES: list[Route] = []  # consulted in order: the first route that matches a data_source grades it


def register_scorer(name: str, *, options: tuple[str, ...] = (), last_chars: int | None = None,
                    data_sources: tuple[str, ...] = (), prefixes: tuple[str, ...] = ()):
    """Decorator: the function is the scorer `name` (reward.custom_function=name and
    reward.data_sources entries name it), and the rows whose data_source is one of
    `data_sources` or starts with one of `prefixes` are graded by it. A taken name, or a
    data_source another scorer already grades, is refused (ValueError)."""
    def register(fn: Callable[..., dict]) -> Callable[..., dict]:
        if name in SCORERS:
            raise ValueError(f"scorer name {name!r} is taken (by {SCORERS[name].fn.__module__}); choose another")
        taken = [d for d in data_sources for route in ROUTES if route.matches(d)]
        if taken:
            raise ValueError(f"scorer {name!r}: data_source {taken[0]!r} is already graded by another scorer")
        SCORERS[name] = Scorer(fn, tuple(options), last_chars)
        if data_sources or prefixes:
            ROUTES.append(Route(name, frozenset(data_sources), tuple(prefixes)))
        return fn
    return register

"""Functions and classes a run's config names by an import string, "module.path:function":
reward functions (reward.custom_function), advantage estimators and policy losses
(algorithm.adv_estimator, algorithm.policy_loss), agent tools (agent.tools.NAME.class). The
module is imported when the string is resolved, never before: megarl does not import
plugins at start-up.

Main entry points: `import_function` and `check_call` (does the function take the call
megarl makes?), each raising ValueError with the setting, the string and the fix.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any


def import_function(import_string: str, what: str, form: str, names: str = "") -> Callable[..., Any]:
    """The callable named by "module.path:function" (the part after ':' may be dotted, e.g.
    "pkg.rewards:Grader.score"). `what` names the setting in messages ("reward
    custom_function"), `form` is what a valid value looks like (the fix), `names` the other
    values the setting takes ("a built-in scorer ['code', ...]"), for a string that is neither."""
    subject = f"{what} {import_string!r}"
    module_name, sep, attribute = import_string.partition(":")
    if not sep or not module_name or not attribute:
        either = f"neither {names} nor" if names else "not"
        raise ValueError(f"{subject} is {either} an import string; write it as {form}")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # not found, or its code failed: a SyntaxError, a registration refused
        raise ValueError(
            f"{subject}: cannot import module {module_name!r} ({type(error).__name__}: {error}); make sure it is "
            "importable (installed, or on PYTHONPATH) in every process of the run: the trainer, its workers, the "
            "reward workers"
        ) from error
    for name in attribute.split("."):
        if not hasattr(target, name):
            raise ValueError(f"{subject}: {target.__name__!r} has no attribute {name!r}; expected {form}")
        target = getattr(target, name)
    if not callable(target):
        raise ValueError(f"{subject} names a {type(target).__name__}, not a function")
    return target


def check_call(fn: Callable[..., Any], subject: str, expected: str, *args: Any, **kwargs: Any) -> None:
    """ValueError where `fn` cannot take the call fn(*args, **kwargs) that megarl makes
    (`expected` spells it out for the user): a function written for another signature would
    otherwise fail only when first called, deep into a run."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without one (some builtins): its first call tells
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        raise ValueError(f"{subject} takes {signature}, but megarl calls it as {expected} ({error})") from None

"""Advantage estimators and policy losses by name: what `algorithm.adv_estimator` and
`algorithm.policy_loss` of the run config select.

A setting is a registered name or an import string "module.path:function". The built-ins
register with the decorators where they are defined (megarl.algo.advantages,
megarl.algo.policy_loss), which megarl.algo imports. A user's function lives in their own file
and is named by its import string; its module is imported when the string is looked up, never
at start-up. The rule for such a function:
- an advantage estimator must be decorated with `register_advantage_estimator`: its kind says
  how megarl calls it, its needs what the run must provide (a critic, groups of samples);
- a policy loss may be plain or decorated with `register_policy_loss` (it has one signature).
Either way the function is checked to take the call megarl makes (megarl.import_string).

Main entry points: `advantage_estimator(name)`, `policy_loss_function(name)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from megarl.import_string import check_call, import_function

EstimatorKind = Literal["outcome", "token"]
SIGNATURES = {
    "outcome": "fn(scores (S,), groups (S,), algo) -> advantages (S,)",
    "token": "fn(batch, token_rewards (B, L), scores (B,), groups (B,), algo) -> (advantages, returns), each (B, L)",
    "policy_loss": "fn(log_prob, old_log_prob, advantages, mask, algo, *, rollout_log_prob, num_tokens, num_seqs, "
                   "norm_length) -> (loss, metrics)",
}
# placeholders for the arguments of each call, to check a function's signature against it
_CALLS: dict[str, tuple[tuple, dict]] = {
    "outcome": (("scores", "groups", "algo"), {}),
    "token": (("batch", "token_rewards", "scores", "groups", "algo"), {}),
    "policy_loss": (("log_prob", "old_log_prob", "advantages", "mask", "algo"),
                    dict.fromkeys(("rollout_log_prob", "num_tokens", "num_seqs", "norm_length"))),
}


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator and what a run needs for it.

    kind "outcome": fn(scores, groups, algo) -> (S,), one advantage per sequence from its
    score (scores float (S,), groups LongTensor (S,) of prompt-group ids, algo the run's
    AlgorithmConfig); megarl broadcasts it over the sequence's loss tokens, and the returns are
    the advantages. kind "token": fn(batch, token_rewards, scores, groups, algo) ->
    (advantages, returns), each (B, L) and zero off batch.loss_mask; batch is a padded
    TrainBatch (loss_mask, values from the critic, ref_log_probs, old_log_probs), token_rewards
    (B, L) holds each score on the row's last loss token, minus the KL penalty when
    algorithm.use_kl_in_reward.
    needs_critic: it reads batch.values (the run needs critic.enable=true).
    needs_groups: it compares the samples of one prompt (the run needs rollout.n >= 2).
    """

    name: str
    fn: Callable[..., Any]
    kind: EstimatorKind
    needs_critic: bool = False
    needs_groups: bool = False


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
POLICY_LOSSES: dict[str, Callable[..., Any]] = {}


def _qualified_name(fn: Callable[..., Any]) -> str:
    """module.name of a function; the repr of another callable (an instance with __call__)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(fn)


def _register(table: dict[str, Any], name: str, entry: Any, fn: Callable[..., Any], what: str) -> None:
    """Add `entry` under `name`. The same function registered again (its module imported anew)
    replaces itself; another function under a taken name is refused."""
    taken = table.get(name)
    if taken is not None and _qualified_name(getattr(taken, "fn", taken)) != _qualified_name(fn):
        raise ValueError(f"{what} {name!r} is registered twice: by {_qualified_name(getattr(taken, 'fn', taken))} "
                         f"and by {_qualified_name(fn)}; give one of them another name")
    table[name] = entry


def _check_signature(fn: Callable[..., Any], subject: str, call: str) -> None:
    args, kwargs = _CALLS[call]
    check_call(fn, subject, SIGNATURES[call], *args, **kwargs)


def register_advantage_estimator(name: str, *, kind: EstimatorKind, needs_critic: bool = False,
                                 needs_groups: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register fn as the advantage estimator `name` (see AdvantageEstimator for
    the kinds and needs). The function is returned unchanged, its registration attached as
    `fn.advantage_estimator`, which is how an import string finds its kind."""
    if kind not in get_args(EstimatorKind):
        raise ValueError(f"advantage estimator {name!r}: kind={kind!r}; use one of {list(get_args(EstimatorKind))}")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _check_signature(fn, f"advantage estimator {name!r} (kind={kind})", kind)
        estimator = AdvantageEstimator(name, fn, kind, needs_critic, needs_groups)
        _register(ADVANTAGE_ESTIMATORS, name, estimator, fn, "advantage estimator")
        fn.advantage_estimator = estimator
        return fn

    return register


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register fn as the policy loss `name`; the function is returned unchanged."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _check_signature(fn, f"policy loss {name!r}", "policy_loss")
        _register(POLICY_LOSSES, name, fn, fn, "policy loss")
        return fn

    return register


def _import(name: str, what: str, table: dict[str, Any], function: str) -> Callable[..., Any]:
    form = f"'module.path:function' ({function})"
    return import_function(name, what, form, names=f"a registered {what} {sorted(table)}")


def advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator `name` names: a registered one, or the decorated function of the import
    string "module.path:function". ValueError saying what is wrong and the choices."""
    if name in ADVANTAGE_ESTIMATORS:
        return ADVANTAGE_ESTIMATORS[name]
    fn = _import(name, "advantage estimator", ADVANTAGE_ESTIMATORS,
                 "a function in your own file, decorated with megarl.algo.register_advantage_estimator")
    estimator = getattr(fn, "advantage_estimator", None)
    if not isinstance(estimator, AdvantageEstimator):
        raise ValueError(f"advantage estimator {name!r} is not decorated with "
                         "@megarl.algo.register_advantage_estimator(NAME, kind='outcome' or 'token'), which tells "
                         f"megarl how to call it: outcome = {SIGNATURES['outcome']}; token = {SIGNATURES['token']}")
    return estimator


def policy_loss_function(name: str) -> Callable[..., Any]:
    """The policy loss `name` names: a registered one, or the function of the import string
    "module.path:function" (decorated or plain), checked to take megarl's call
    (SIGNATURES["policy_loss"]). ValueError saying what is wrong and the choices."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    fn = _import(name, "policy loss", POLICY_LOSSES,
                 f"a function in your own file, {SIGNATURES['policy_loss']}, plain or decorated with "
                 "megarl.algo.register_policy_loss")
    _check_signature(fn, f"policy loss {name!r}", "policy_loss")
    return fn

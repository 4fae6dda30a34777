"""Advantage estimators and policy losses by name (megarl.algo.registry): the built-ins as the
formulas compute them, CISPO by hand, a user's own functions in a file outside the package used
through the run config, and the config's checks (unknown names, what an estimator needs)."""

from __future__ import annotations

import itertools
import math
import sys

import pytest
import torch

from megarl.algo import (compute_gae_advantages, compute_grpo_advantages, compute_reinforce_plus_plus_advantages,
                         compute_reinforce_plus_plus_baseline_advantages, compute_rloo_advantages, policy_loss,
                         policy_loss_function, register_advantage_estimator, register_policy_loss,
                         scores_to_token_rewards)
from megarl.algo import registry
from megarl.backends.batch import TrainBatch
from megarl.backends.loss import actor_loss
from megarl.config import AlgorithmConfig, load_config
from megarl.experience import compute_advantages, to_train_batch
from test_config import problems_of
from test_experience import SAMPLES

# The user's file: an outcome and a token estimator, a plain policy loss, and things that are not
# what the settings take.
PLUGIN = '''
import torch
from megarl.algo import register_advantage_estimator

@register_advantage_estimator("batch_mean", kind="outcome")
def batch_mean(scores, groups, algo):
    """A_i = r_i - mean of the batch's scores."""
    return scores - scores.mean()

@register_advantage_estimator("score_to_go", kind="token")
def score_to_go(batch, token_rewards, scores, groups, algo):
    """The undiscounted reward to go on every loss token, as advantages and returns."""
    to_go = token_rewards.flip(-1).cumsum(-1).flip(-1) * batch.loss_mask
    return to_go, to_go

@register_advantage_estimator("needs_everything", kind="outcome", needs_critic=True, needs_groups=True)
def needs_everything(scores, groups, algo):
    return scores

@register_advantage_estimator("wrong_shape", kind="outcome")
def wrong_shape(scores, groups, algo):
    return scores[:1]

def vanilla_pg(log_prob, old_log_prob, advantages, mask, algo, *, rollout_log_prob=None, num_tokens=None,
               num_seqs=None, norm_length=None):
    """L = -A * logp, mean over the loss tokens; not decorated: a policy loss may be plain."""
    m = mask.float()
    loss = -(advantages * log_prob * m).sum() / m.sum()
    return loss, {"pg_loss": float(loss.detach())}

def undecorated_estimator(scores, groups, algo):
    return scores

def loss_of_two(log_prob, advantages):
    return log_prob.sum()

NOT_A_FUNCTION = 3
'''


_MODULE_NUMBERS = itertools.count()


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The name of a fresh module holding PLUGIN, importable from tmp_path; the registries are
    restored after the test."""
    name = f"user_algos_{next(_MODULE_NUMBERS)}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "ADVANTAGE_ESTIMATORS", dict(registry.ADVANTAGE_ESTIMATORS))
    monkeypatch.setattr(registry, "POLICY_LOSSES", dict(registry.POLICY_LOSSES))
    yield name
    sys.modules.pop(name, None)


SCORES, GROUPS = [1.0, 0.0, 3.0, 0.0], [0, 0, 1, 1]
# the rows' tokens (prompt, response), packed, and their loss mask: see test_experience.SAMPLES
LOSS_MASK = [0, 0, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 0, 1]


def test_a_users_outcome_estimator_through_the_config(plugin):
    cfg = load_config(None, [f"algorithm.adv_estimator={plugin}:batch_mean"])
    advantages, returns, _ = compute_advantages(to_train_batch(SAMPLES), SCORES, GROUPS, cfg.algorithm)
    # mean score 1: A = [0, -1, 2, -1], each on its row's loss tokens (rows of 5, 3, 3, 5 tokens)
    per_row = [0.0] * 5 + [-1.0] * 3 + [2.0] * 3 + [-1.0] * 5
    expected = torch.tensor([a * m for a, m in zip(per_row, LOSS_MASK)])
    torch.testing.assert_close(advantages, expected)
    assert returns is advantages


def test_a_users_token_estimator_through_the_config(plugin):
    cfg = load_config(None, [f"algorithm.adv_estimator={plugin}:score_to_go"])
    advantages, returns, _ = compute_advantages(to_train_batch(SAMPLES), SCORES, GROUPS, cfg.algorithm)
    # the score sits on the row's last loss token; to go from each loss token it is the whole score
    per_row = [1.0] * 5 + [0.0] * 3 + [3.0] * 3 + [0.0] * 5
    expected = torch.tensor([s * m for s, m in zip(per_row, LOSS_MASK)])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def test_a_token_estimator_gets_the_kl_penalty_in_its_token_rewards(plugin):
    cfg = load_config(None, [f"algorithm.adv_estimator={plugin}:score_to_go", "algorithm.use_kl_in_reward=true",
                             "algorithm.kl_reward_coef=0.1", "algorithm.kl_reward_type=k1"])
    batch = to_train_batch(SAMPLES)
    old, ref = torch.zeros(batch.num_tokens), torch.full((batch.num_tokens,), -0.5)
    advantages, _, metrics = compute_advantages(batch, SCORES, GROUPS, cfg.algorithm, ref_log_probs=ref,
                                                old_log_probs=old)
    # k1 = old − ref = 0.5 on each loss token, times 0.1: each loss token's reward is 0.05 less
    expected = [0, 0, 0.9, 0, 0.95] + [0, 0, -0.05] + [0, 2.9, 2.95] + [0, -0.15, -0.1, 0, -0.05]
    torch.testing.assert_close(advantages, torch.tensor(expected))
    assert metrics == {"kl_in_reward": pytest.approx(0.5)}


def test_an_estimator_returning_the_wrong_shape_is_named(plugin):
    cfg = load_config(None, [f"algorithm.adv_estimator={plugin}:wrong_shape"])
    with pytest.raises(ValueError, match=r"'wrong_shape' \(outcome\) returned advantages of shape \(1,\), expected \(4,\)"):
        compute_advantages(to_train_batch(SAMPLES), SCORES, GROUPS, cfg.algorithm)


def micro_batch() -> TrainBatch:
    mask = torch.tensor([[1, 1], [1, 0]])
    return TrainBatch(input_ids=torch.zeros(2, 2, dtype=torch.long), attention_mask=torch.ones(2, 2), loss_mask=mask,
                      old_log_probs=torch.zeros(2, 2), rollout_log_probs=torch.zeros(2, 2),
                      advantages=torch.tensor([[1.0, 1.0], [-2.0, -2.0]]))


def test_a_users_plain_policy_loss_through_the_config_and_actor_loss(plugin):
    cfg = load_config(None, [f"algorithm.policy_loss={plugin}:vanilla_pg"])
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    loss, metrics = actor_loss(log_probs, torch.zeros(2, 2), micro_batch(), cfg.algorithm, {})
    # -(1·-1 + 1·-2 + -2·-0.5) / 3 tokens = 2/3; d/dlogp = -A·m / 3
    assert loss.item() == pytest.approx(2 / 3) and metrics["pg_loss"] == pytest.approx(2 / 3)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1 / 3, -1 / 3], [2 / 3, 0.0]]))


@pytest.mark.parametrize("setting, value, words", [
    ("adv_estimator", "ppo", "neither a registered advantage estimator ['gae', 'grpo', 'reinforce_plus_plus', "
                             "'reinforce_plus_plus_baseline', 'rloo'] nor an import string"),
    ("adv_estimator", "no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("adv_estimator", "{plugin}:missing", "has no attribute 'missing'"),
    ("adv_estimator", "{plugin}:NOT_A_FUNCTION", "names a int, not a function"),
    ("adv_estimator", "{plugin}:undecorated_estimator", "is not decorated with"),
    ("policy_loss", "vanilla", "neither a registered policy loss ['cispo', 'ppo'] nor an import string"),
    ("policy_loss", "{plugin}:", "nor an import string; write it as 'module.path:function' (a function in your own"),
    ("policy_loss", "{plugin}:loss_of_two", "takes (log_prob, advantages), but megarl calls it as fn(log_prob, "
                                            "old_log_prob, advantages, mask, algo, *, rollout_log_prob"),
])
def test_a_name_that_is_no_function_is_a_config_problem_of_its_key(plugin, setting, value, words):
    (found,) = problems_of([f"algorithm.{setting}={value.format(plugin=plugin)}"])
    assert found[0] == f"algorithm.{setting}"
    assert words in found[1]


def test_a_module_that_fails_to_import_is_a_config_problem(tmp_path, monkeypatch):
    (tmp_path / "broken_user_algos.py").write_text("import torch\nraise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (found,) = problems_of(["algorithm.policy_loss=broken_user_algos:loss"])
    assert found[0] == "algorithm.policy_loss"
    assert "cannot import module 'broken_user_algos' (RuntimeError: no GPU here)" in found[1]


@pytest.mark.parametrize("estimator, overrides, key, words", [
    ("gae", [], "algorithm.adv_estimator", "gae needs a critic"),
    ("grpo", ["rollout.n=1", "actor.ppo_micro_batch_size=1"], "rollout.n", "so grpo has no baseline"),
    ("rloo", ["rollout.n=1", "actor.ppo_micro_batch_size=1"], "rollout.n", "so rloo has no baseline"),
    ("reinforce_plus_plus_baseline", ["rollout.n=1", "actor.ppo_micro_batch_size=1"], "rollout.n", "no baseline"),
    ("{plugin}:needs_everything", [], "algorithm.adv_estimator", "needs a critic"),
    ("{plugin}:needs_everything", ["critic.enable=true", "rollout.n=1", "actor.ppo_micro_batch_size=1",
                                   "critic.ppo_micro_batch_size=1"], "rollout.n", "no baseline"),
])
def test_what_an_estimator_needs_comes_from_its_registration(plugin, estimator, overrides, key, words):
    (found,) = problems_of([f"algorithm.adv_estimator={estimator.format(plugin=plugin)}", *overrides])
    assert found[0] == key and words in found[1]


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "{plugin}:batch_mean"])
def test_an_estimator_without_groups_takes_one_sample_a_prompt(plugin, estimator):
    load_config(None, [f"algorithm.adv_estimator={estimator.format(plugin=plugin)}", "rollout.n=1",
                       "actor.ppo_micro_batch_size=1"])


def test_a_taken_name_is_refused_and_a_reimported_function_replaces_itself(monkeypatch):
    monkeypatch.setattr(registry, "ADVANTAGE_ESTIMATORS", dict(registry.ADVANTAGE_ESTIMATORS))
    monkeypatch.setattr(registry, "POLICY_LOSSES", dict(registry.POLICY_LOSSES))

    def grpo(scores, groups, algo):
        return scores

    with pytest.raises(ValueError, match="'grpo' is registered twice: by megarl.algo.advantages.grpo_estimator and"):
        register_advantage_estimator("grpo", kind="outcome")(grpo)
    with pytest.raises(ValueError, match="'ppo' is registered twice"):
        register_policy_loss("ppo")(registry.POLICY_LOSSES["cispo"])
    ppo = registry.POLICY_LOSSES["ppo"]
    assert register_policy_loss("ppo")(ppo) is ppo  # what a module imported anew does


def test_the_decorator_checks_the_kind_and_the_signature():
    with pytest.raises(ValueError, match="kind='sequence'; use one of \\['outcome', 'token'\\]"):
        register_advantage_estimator("x", kind="sequence")
    with pytest.raises(ValueError, match="takes \\(scores, groups, algo\\), but megarl calls it as fn\\(batch, "):
        register_advantage_estimator("x", kind="token")(lambda scores, groups, algo: scores)


def test_every_registered_name_is_in_the_settings_help():
    from dataclasses import fields

    help_of = {f.name: f.metadata["help"] for f in fields(AlgorithmConfig)}
    for name in registry.ADVANTAGE_ESTIMATORS:
        assert name in help_of["adv_estimator"]
    for name in registry.POLICY_LOSSES:
        assert name in help_of["policy_loss"]


# --- the built-ins: the registry's adapters compute what the formulas do ---------------------

def padded_rows():
    batch = to_train_batch(SAMPLES)
    torch.manual_seed(0)
    batch = batch.with_fields(values=torch.randn(batch.num_tokens))
    return batch, batch.only("values").padded()


@pytest.mark.parametrize("estimator, norm_by_std, gamma, lam", [
    *[("grpo", norm, 1.0, 1.0) for norm in (True, False)],
    ("rloo", True, 1.0, 1.0),
    *[("reinforce_plus_plus", True, g, 1.0) for g in (1.0, 0.9)],
    ("reinforce_plus_plus_baseline", True, 1.0, 1.0),
    *[("gae", True, g, lam) for g, lam in itertools.product((1.0, 0.9), (1.0, 0.95))],
])
def test_the_builtin_estimators_compute_their_formulas(estimator, norm_by_std, gamma, lam):
    batch, rows = padded_rows()
    algo = AlgorithmConfig(adv_estimator=estimator, norm_adv_by_std=norm_by_std, gamma=gamma, lam=lam)
    scores, groups = torch.tensor(SCORES), torch.tensor(GROUPS)
    advantages, returns, _ = compute_advantages(batch, SCORES, GROUPS, algo)
    rewards = scores_to_token_rewards(scores, rows.loss_mask)
    if estimator in ("grpo", "rloo"):
        per_seq = (compute_grpo_advantages(scores, groups, norm_by_std) if estimator == "grpo"
                   else compute_rloo_advantages(scores, groups))
        expected = (per_seq[:, None] * rows.loss_mask, per_seq[:, None] * rows.loss_mask)
    elif estimator == "reinforce_plus_plus":
        expected = compute_reinforce_plus_plus_advantages(rewards, rows.loss_mask, gamma)
    elif estimator == "reinforce_plus_plus_baseline":
        expected = compute_reinforce_plus_plus_baseline_advantages(scores, groups, rows.loss_mask)
    else:
        expected = compute_gae_advantages(rewards, rows.values, rows.loss_mask, gamma, lam)
    torch.testing.assert_close(advantages, batch.pack(expected[0]), rtol=0, atol=0)
    torch.testing.assert_close(returns, batch.pack(expected[1]), rtol=0, atol=0)


@pytest.mark.parametrize("ratio_level, tis_cap, tis_level, loss_agg_mode", [
    ("token", None, "token", "token-mean"),
    ("sequence", None, "token", "seq-mean-token-mean"),
    ("token", 1.5, "token", "seq-mean-token-sum"),
    ("token", 1.5, "sequence", "seq-mean-token-sum-norm"),
])
def test_ppo_is_policy_loss_with_the_runs_settings(ratio_level, tis_cap, tis_level, loss_agg_mode):
    algo = AlgorithmConfig(clip_ratio_low=0.1, clip_ratio_high=0.2, clip_ratio_c=2.0, ratio_level=ratio_level,
                           tis_cap=tis_cap, tis_level=tis_level, loss_agg_mode=loss_agg_mode)
    torch.manual_seed(1)
    old, rollout, advantages = -torch.rand(3, 4), -torch.rand(3, 4), torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 1, 1, 1]])
    base = old + 0.3 * torch.randn(3, 4)
    counts = {"num_tokens": 9, "num_seqs": 3, "norm_length": 4}
    by_name, direct = base.clone().requires_grad_(), base.clone().requires_grad_()
    loss, metrics = policy_loss_function("ppo")(by_name, old, advantages, mask, algo, rollout_log_prob=rollout,
                                                **counts)
    expected, expected_metrics = policy_loss(
        direct, old, advantages, mask, clip_ratio_low=0.1, clip_ratio_high=0.2, clip_ratio_c=2.0,
        loss_agg_mode=loss_agg_mode, ratio_level=ratio_level, rollout_log_prob=rollout, tis_cap=tis_cap,
        tis_level=tis_level, **counts)
    (loss + expected).backward()
    assert torch.equal(loss, expected) and metrics == expected_metrics
    assert torch.equal(by_name.grad, direct.grad)


# --- CISPO by hand ---------------------------------------------------------------------------

def test_cispo_value_and_gradient_by_hand():
    # old = 0, so the ratios are exp(logp): 2, 0.5, 1.1 and (masked) 10. With low 0.2, high 0.28
    # the weights are clip(ρ, 0.8, 1.28) = 1.28, 0.8, 1.1; the gradient goes through logp only.
    log_prob = torch.tensor([[math.log(2.0), math.log(0.5), math.log(1.1), math.log(10.0)]], dtype=torch.float64,
                            requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, 2.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    algo = AlgorithmConfig(policy_loss="cispo", clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, metrics = policy_loss_function("cispo")(log_prob, torch.zeros_like(log_prob), advantages, mask, algo)
    token_losses = [-1.28 * 1.0 * math.log(2.0), -0.8 * -1.0 * math.log(0.5), -1.1 * 2.0 * math.log(1.1)]
    assert loss.item() == pytest.approx(sum(token_losses) / 3)  # token-mean over the 3 loss tokens
    loss.backward()
    # ∂/∂logp_t = -w_t·A_t / 3; without the stop-gradient the unclipped third token would add -A·logp·ρ / 3
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.28 / 3, 0.8 / 3, -2.2 / 3, 0.0]], dtype=torch.float64))
    assert metrics["clipfrac"] == pytest.approx(2 / 3)
    assert metrics["clipfrac_low"] == pytest.approx(1 / 3) and metrics["clipfrac_high"] == pytest.approx(1 / 3)


def test_cispo_weighs_by_tis_and_is_chosen_by_the_config():
    cfg = load_config(None, ["algorithm.policy_loss=cispo", "algorithm.tis_cap=2.0"])
    log_prob = torch.tensor([[0.0, 0.0]], requires_grad=True)  # ρ = 1: weight 1
    rollout = torch.tensor([[-math.log(1.5), -math.log(4.0)]])  # TIS weights exp(old − rollout) = 1.5, 4 → capped 2
    micro = TrainBatch(input_ids=torch.zeros(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 2),
                       loss_mask=torch.ones(1, 2), old_log_probs=torch.zeros(1, 2), rollout_log_probs=rollout,
                       advantages=torch.tensor([[1.0, 1.0]]))
    loss, metrics = actor_loss(log_prob, torch.zeros(1, 2), micro, cfg.algorithm, {})
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.5 / 2, -2.0 / 2]]))
    assert metrics["tis_clipfrac"] == pytest.approx(0.5)


# ---- the registry's messages, word for word: a user reads them when a setting is wrong ----

def _outcome(scores, groups, algo):
    return scores


def _loss(log_prob, old_log_prob, advantages, mask, algo, *, rollout_log_prob=None, num_tokens=None, num_seqs=None,
          norm_length=None):
    return log_prob.sum(), {}


def test_a_taken_name_is_named_with_both_functions(monkeypatch):
    monkeypatch.setattr(registry, "ADVANTAGE_ESTIMATORS", dict(registry.ADVANTAGE_ESTIMATORS))
    monkeypatch.setattr(registry, "POLICY_LOSSES", dict(registry.POLICY_LOSSES))
    with pytest.raises(ValueError) as error:
        register_advantage_estimator("rloo", kind="outcome")(_outcome)
    assert str(error.value) == ("advantage estimator 'rloo' is registered twice: by megarl.algo.advantages."
                                "rloo_estimator and by test_algo_registry._outcome; give one of them another name")
    with pytest.raises(ValueError) as error:
        register_policy_loss("cispo")(_loss)
    assert str(error.value) == ("policy loss 'cispo' is registered twice: by megarl.algo.policy_loss.cispo_policy_loss "
                                "and by test_algo_registry._loss; give one of them another name")
    rloo = registry.ADVANTAGE_ESTIMATORS["rloo"]  # a module imported anew registers its estimator again
    assert register_advantage_estimator("rloo", kind="outcome", needs_groups=True)(rloo.fn) is rloo.fn
    assert registry.ADVANTAGE_ESTIMATORS["rloo"].fn is rloo.fn
    register_policy_loss("mine")(_loss)
    assert registry.POLICY_LOSSES["mine"] is _loss


def test_a_signature_megarl_cannot_call_is_refused_by_name():
    def no_counts(log_prob, old_log_prob, advantages, mask, algo):  # the keyword arguments missing
        return log_prob.sum(), {}

    with pytest.raises(ValueError, match=r"^policy loss 'bare' takes \(log_prob, old_log_prob, advantages, mask, "
                                         r"algo\), but megarl calls it as fn\(log_prob"):
        register_policy_loss("bare")(no_counts)
    with pytest.raises(ValueError, match=r"^advantage estimator 'two' \(kind=outcome\) takes \(scores, groups\)"):
        register_advantage_estimator("two", kind="outcome")(lambda scores, groups: scores)


def test_the_names_and_forms_of_unknown_settings():
    with pytest.raises(ValueError) as error:
        registry.advantage_estimator("grpoo")
    assert str(error.value) == (
        "advantage estimator 'grpoo' is neither a registered advantage estimator ['gae', 'grpo', "
        "'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'rloo'] nor an import string; write it as "
        "'module.path:function' (a function in your own file, decorated with "
        "megarl.algo.register_advantage_estimator)")
    with pytest.raises(ValueError) as error:
        policy_loss_function("ppoo")
    assert str(error.value) == (
        f"policy loss 'ppoo' is neither a registered policy loss ['cispo', 'ppo'] nor an import string; write it as "
        f"'module.path:function' (a function in your own file, {registry.SIGNATURES['policy_loss']}, plain or "
        "decorated with megarl.algo.register_policy_loss)")
    with pytest.raises(ValueError) as error:
        registry.advantage_estimator("test_algo_registry:_outcome")
    assert str(error.value) == (
        "advantage estimator 'test_algo_registry:_outcome' is not decorated with "
        "@megarl.algo.register_advantage_estimator(NAME, kind='outcome' or 'token'), which tells megarl how to call "
        f"it: outcome = {registry.SIGNATURES['outcome']}; token = {registry.SIGNATURES['token']}")
    with pytest.raises(ValueError, match=r"^policy loss 'test_algo_registry:_outcome' takes \(scores, groups, algo\)"):
        policy_loss_function("test_algo_registry:_outcome")


class _Scaled:
    """A callable object as an estimator: it has a module (its class's) but no name of its own."""

    def __init__(self, label: str):
        self.label = label

    def __call__(self, scores, groups, algo):
        return 2 * scores

    def __repr__(self):
        return f"<_Scaled {self.label}>"


def test_a_callable_object_is_named_by_its_repr(monkeypatch):
    monkeypatch.setattr(registry, "ADVANTAGE_ESTIMATORS", dict(registry.ADVANTAGE_ESTIMATORS))
    register_advantage_estimator("scaled", kind="outcome")(_Scaled("a"))
    with pytest.raises(ValueError) as error:
        register_advantage_estimator("scaled", kind="outcome")(_Scaled("b"))
    assert str(error.value) == ("advantage estimator 'scaled' is registered twice: by <_Scaled a> and by "
                                "<_Scaled b>; give one of them another name")


class _Nameless(_Scaled):
    """A callable without even a module (some wrappers' objects)."""

    def __getattribute__(self, name):
        if name in ("__module__", "__qualname__"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)


def test_a_callable_without_a_module_is_named_by_its_repr_too(monkeypatch):
    monkeypatch.setattr(registry, "ADVANTAGE_ESTIMATORS", dict(registry.ADVANTAGE_ESTIMATORS))
    register_advantage_estimator("nameless", kind="outcome")(_Nameless("c"))
    with pytest.raises(ValueError, match=r"^advantage estimator 'nameless' is registered twice: by <_Scaled c> and "
                                         r"by test_algo_registry._outcome;"):
        register_advantage_estimator("nameless", kind="outcome")(_outcome)

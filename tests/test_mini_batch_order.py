"""The order an update cuts its batch into mini-batches (actor.shuffle_mini_batches): a random
order drawn from the seed and the step only, the same update as in order when one mini-batch
holds the whole step, and mini-batches that mix the step's groups."""

from __future__ import annotations

import copy

import pytest
import torch

from megarl.backends.epochs import shuffled
from megarl.backends.torch.actor import TorchActor
from megarl.config import AlgorithmConfig, OptimConfig, load_config
from megarl.train import update_order
from test_backend_torch_actor import random_batch
from tiny_models import tiny_model


def test_the_order_is_a_permutation_drawn_from_the_seed_and_the_step_only():
    batch, _ = random_batch(rows=16)
    first = shuffled(batch, seed=42, step=3)
    rows = [tuple(r) for r in batch.input_ids.tolist()]
    moved = [tuple(r) for r in first.input_ids.tolist()]
    assert sorted(moved) == sorted(rows) and moved != rows  # every row once, not in order
    torch.manual_seed(0)  # the global generator plays no part: a resumed run draws the same
    again = shuffled(batch, seed=42, step=3)
    assert torch.equal(again.input_ids, first.input_ids) and torch.equal(again.loss_mask, first.loss_mask)
    assert not torch.equal(shuffled(batch, seed=42, step=4).input_ids, first.input_ids)
    assert not torch.equal(shuffled(batch, seed=7, step=3).input_ids, first.input_ids)
    # every per-row field moves with its row
    where = {r: i for i, r in enumerate(rows)}
    order = [where[r] for r in moved]
    assert torch.equal(first.attention_mask, batch.attention_mask[order])


def test_off_keeps_the_generated_order():
    batch, _ = random_batch()
    cfg = load_config(None, ["actor.shuffle_mini_batches=false"])
    assert update_order(batch, cfg.actor, cfg, step=1) is batch
    cfg = load_config(None, [])
    assert cfg.actor.shuffle_mini_batches and cfg.critic.shuffle_mini_batches  # on by default
    assert not torch.equal(update_order(batch, cfg.actor, cfg, step=1).input_ids, batch.input_ids)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_one_mini_batch_takes_the_same_step_shuffled_or_in_order(mode):
    # the loss of one mini-batch is a sum over its rows: the order only changes the rounding
    batch, g = random_batch(rows=8)
    base = tiny_model("qwen2")
    algo = AlgorithmConfig(loss_agg_mode=mode)
    optim = OptimConfig(lr=1e-3, eps=1e-3, lr_warmup_steps=0, weight_decay=0.0)  # eps: see the micro-batch test
    old, _ = TorchActor(base, algo, optim, mini_batch_samples=8, micro_batch_samples=8).compute_log_prob(batch)
    batch = batch.with_fields(old_log_probs=old + 0.05 * torch.randn(old.shape, generator=g),
                              advantages=torch.randn(old.shape, generator=g))
    states = []
    for rows in (batch, shuffled(batch, seed=1, step=0)):
        model = copy.deepcopy(base)
        TorchActor(model, algo, optim, mini_batch_samples=8, micro_batch_samples=2).update_actor(rows)
        states.append(model.state_dict())
    moved = 0.0
    for name, tensor in states[0].items():
        torch.testing.assert_close(states[1][name], tensor, atol=2e-6, rtol=0)
        moved = max(moved, float((tensor - base.state_dict()[name]).abs().max()))
    assert moved > 1e-4  # the step did move the weights


def test_shuffled_mini_batches_mix_the_groups():
    # 4 groups of 4 samples, as generated (group g in rows 4g..4g+3), and mini-batches of 4: in
    # order each mini-batch is one group; shuffled, every mini-batch holds several groups (a random
    # order keeps some mini-batch to one group about once in 110 draws; these seeds' orders do not)
    batch, _ = random_batch(rows=16)
    group_of_row = {tuple(r): i // 4 for i, r in enumerate(batch.input_ids.tolist())}

    def groups_per_mini(b):
        rows = [group_of_row[tuple(r)] for r in b.input_ids.tolist()]
        return [len(set(rows[i:i + 4])) for i in range(0, 16, 4)]

    assert groups_per_mini(batch) == [1, 1, 1, 1]
    for seed, step in [(42, 0), (42, 1), (7, 0), (7, 5), (0, 0)]:
        assert min(groups_per_mini(shuffled(batch, seed=seed, step=step))) > 1, (seed, step)


def test_a_default_step_updates_the_actor_on_mini_batches_that_mix_the_prompts(tiny_inputs, tmp_path, monkeypatch):
    """The default path (actor and critic in one order: the batch is built in the update's order,
    megarl.train.in_update_order), through a whole step: 2 prompts x 4 samples, generated group by
    group, cut into mini-batches of 4 samples. In the generated order each mini-batch would hold one
    prompt's samples; the actor must see both prompts in each. (Before this test, in_update_order
    could return the samples unshuffled with every test passing.)"""
    from megarl.components import build_components
    from megarl.train import train_step
    from train_fixtures import tiny_overrides

    c = build_components(load_config(None, tiny_overrides(tiny_inputs, tmp_path) + ["data.shuffle=false"]))
    seen = []
    update = c.worker.update_actor

    def recorded(batch):
        starts, lengths = batch.starts().tolist(), batch.lengths.tolist()
        seen.append([tuple(batch.input_ids[s: s + 6].tolist()) for s, n in zip(starts, lengths)])  # a row's prompt start
        return update(batch)

    monkeypatch.setattr(c.worker, "update_actor", recorded)
    try:
        train_step(c, 0)
    finally:
        c.close()
    (rows,) = seen
    prompts = sorted(set(rows))
    assert len(rows) == 8 and len(prompts) == 2 and all(rows.count(p) == 4 for p in prompts)
    assert [len(set(rows[i:i + 4])) for i in (0, 4)] == [2, 2]  # each mini-batch mixes the two prompts


def order_config(*overrides: str):
    return load_config(None, ["trainer.seed=11", *overrides])


class RecordingWorker:
    """Records what each update gets: (row lengths in order, the per-token fields sent)."""

    def __init__(self):
        self.got = {}

    def _record(self, name, batch):
        fields = sorted(f for f in ("old_log_probs", "ref_log_probs", "rollout_log_probs", "advantages", "returns",
                                    "values") if getattr(batch, f) is not None)
        self.got[name] = (batch.lengths.tolist(), fields)
        return {"loss": 0.5}

    def update_critic(self, batch):
        return self._record("critic", batch)

    def update_actor(self, batch):
        return self._record("actor", batch)


def full_batch():
    from test_packed_batch import packed

    batch = packed()
    n = batch.num_tokens
    return batch.with_fields(**{f: torch.zeros(n) for f in ("old_log_probs", "ref_log_probs", "advantages",
                                                           "returns", "values")})


@pytest.mark.parametrize("critic, actor_shuffles, critic_shuffles, built_shuffled", [
    (False, True, True, True),  # the default: the batch is built in the update's order
    (False, False, True, False),  # the actor in generation order (the critic is off: its setting is not asked)
    (True, True, True, True),  # both shuffle: one order
    (True, True, False, False),  # they disagree: the batch stays in generation order, each update gets its own
])
def test_the_update_order_of_each_worker(critic, actor_shuffles, critic_shuffles, built_shuffled):
    from types import SimpleNamespace

    from megarl.backends.epochs import update_permutation
    from megarl.train import in_update_order, updates

    on = {True: "true", False: "false"}
    cfg = order_config(f"critic.enable={on[critic]}", f"actor.shuffle_mini_batches={on[actor_shuffles]}",
                       f"critic.shuffle_mini_batches={on[critic_shuffles]}")
    permutation = update_permutation(6, 11, 5).tolist()
    assert in_update_order(cfg, list("abcdef"), 5) == ([list("abcdef")[i] for i in permutation] if built_shuffled
                                                       else list("abcdef"))
    batch, worker, metrics = full_batch(), RecordingWorker(), {}
    updates(SimpleNamespace(cfg=cfg, worker=worker), batch, 5, metrics)
    lengths = batch.lengths.tolist()
    shuffled_lengths = [lengths[i] for i in permutation]
    assert shuffled_lengths != lengths  # the two orders can be told apart
    # a batch built in one order is sent as it is; otherwise each update shuffles its copy itself
    actor_order = shuffled_lengths if actor_shuffles and not built_shuffled and critic else lengths
    assert worker.got["actor"] == (actor_order, ["advantages", "old_log_probs"])
    assert metrics["actor/loss"] == 0.5 and metrics["timing/update_actor_s"] >= 0
    if critic:
        critic_order = shuffled_lengths if critic_shuffles and not built_shuffled else lengths
        assert worker.got["critic"] == (critic_order, ["returns", "values"])
        assert metrics["critic/loss"] == 0.5 and metrics["timing/update_critic_s"] >= 0
    else:
        assert "critic" not in worker.got and not any(k.startswith("critic/") for k in metrics)


def test_the_actor_gets_the_fields_its_loss_reads():
    from types import SimpleNamespace

    from megarl.train import updates

    worker = RecordingWorker()
    cfg = order_config("algorithm.tis_cap=2.0", "algorithm.use_kl_loss=true", "actor.shuffle_mini_batches=false")
    updates(SimpleNamespace(cfg=cfg, worker=worker), full_batch(), 0, {})
    assert worker.got["actor"][1] == ["advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs"]

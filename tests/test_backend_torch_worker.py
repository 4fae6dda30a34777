"""Torch TrainWorker: exported weight buckets, reference model, checkpoint round trip and resume."""

from __future__ import annotations

import asyncio
import copy
import random

import numpy as np
import pytest
import torch

from megarl.backends.torch.worker import TorchTrainWorker
from megarl.config import load_config
from megarl.rollout.engine import SamplingParams
from megarl.rollout.local import LocalEngine
from megarl.weights.buckets import flatten, unpack_bucket, verify_engine
from megarl.weights.inprocess import load_into_engine
from test_backend_torch_actor import random_batch
from tiny_models import reference_log_probs, tiny_model

CFG = ["rollout.n=2", "data.train_batch_size=4", "data.gen_batch_size=4", "actor.ppo_mini_batch_size=4",
       "actor.ppo_micro_batch_size=2", "actor.optim.lr=1e-3", "actor.optim.lr_warmup_steps=0",
       "rollout.max_response_length=64", "algorithm.overlong.buffer_len=16"]


def test_buckets_cover_the_state_once_and_respect_the_size():
    for tie in (False, True):
        model = tiny_model("qwen2", tie=tie)
        limit = 40_000
        buckets = list(TorchTrainWorker(model, load_config(None, CFG), 1).export_hf_weights(limit))
        expected = [n for n in model.state_dict() if not (tie and n == "lm_head.weight")]
        assert [n for b in buckets for n in b] == expected
        for b in buckets:
            assert sum(t.numel() * t.element_size() for t in b.values()) <= limit or len(b) == 1
        flat = {n: t for b in buckets for n, t in unpack_bucket(flatten(b)).items()}  # as it crosses processes
        for name in expected:
            assert torch.equal(flat[name], model.state_dict()[name])


def test_exported_weights_sync_into_the_engine_exactly():
    trained, fresh = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=2)
    worker = TorchTrainWorker(trained, load_config(None, CFG), total_steps=1)
    engine = LocalEngine(fresh, eos_token_ids=[])

    async def go():
        await load_into_engine(engine, worker.export_hf_weights(bucket_bytes=50_000), version=1)
        await verify_engine(engine, worker.weight_checksums())
        out = await engine.generate([4, 5, 6], SamplingParams(max_new_tokens=6, temperature=0.0))
        await engine.close()
        return out

    out = asyncio.run(go())
    for name, tensor in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor)
    torch.testing.assert_close(torch.tensor(out.log_probs), reference_log_probs(trained, [4, 5, 6], out.token_ids),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("offload", [False, True])
def test_reference_stays_frozen(offload):
    batch, g = random_batch()
    worker = TorchTrainWorker(tiny_model("qwen2"), load_config(None, CFG + [
        "algorithm.use_kl_loss=true", f"actor.reference_offload={str(offload).lower()}"]), 1)
    ref_before = worker.compute_ref_log_prob(batch)
    old, _ = worker.compute_log_prob(batch)
    torch.testing.assert_close(ref_before, old)
    worker.update_actor(batch.with_fields(old_log_probs=old, advantages=torch.randn(old.shape, generator=g),
                                          ref_log_probs=ref_before))
    new, _ = worker.compute_log_prob(batch)
    assert not torch.allclose(new, old)
    torch.testing.assert_close(worker.compute_ref_log_prob(batch), ref_before)


@pytest.mark.parametrize("tie", [False, True])  # tied embeddings are stored once
def test_checkpoint_resume_equals_an_uninterrupted_run(tmp_path, tie):
    cfg = load_config(None, CFG + ["critic.enable=true", "critic.ppo_mini_batch_size=4",
                                   "critic.ppo_micro_batch_size=2", "algorithm.adv_estimator=gae"])
    batch, g = random_batch(seed=9)
    advantages = torch.randn(batch.input_ids.shape, generator=g)
    returns = torch.randn(batch.input_ids.shape, generator=g)

    def step(worker):
        old, _ = worker.compute_log_prob(batch)
        values = worker.compute_values(batch)
        worker.update_critic(batch.with_fields(values=values, returns=returns))
        worker.update_actor(batch.with_fields(old_log_probs=old, advantages=advantages))
        return torch.rand(3), np.random.rand(), random.random()  # RNG streams continue across the resume

    base = tiny_model("qwen2", tie=tie)
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    straight = TorchTrainWorker(copy.deepcopy(base), cfg, total_steps=4)
    step(straight)
    draws_straight = step(straight)

    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    first = TorchTrainWorker(copy.deepcopy(base), cfg, total_steps=4)
    step(first)
    first.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(123), np.random.seed(123), random.seed(123)  # a new process starts elsewhere
    resumed = TorchTrainWorker(tiny_model("qwen2", tie=tie, seed=5), cfg, total_steps=4)
    resumed.load_checkpoint(tmp_path / "ckpt")
    draws_resumed = step(resumed)

    for name, tensor in straight.actor.model.state_dict().items():
        torch.testing.assert_close(resumed.actor.model.state_dict()[name], tensor, atol=0, rtol=0)
    for name, tensor in straight.critic.model.state_dict().items():
        torch.testing.assert_close(resumed.critic.model.state_dict()[name], tensor, atol=0, rtol=0)
    assert torch.equal(draws_straight[0], draws_resumed[0]) and draws_straight[1:] == draws_resumed[1:]
    assert resumed.actor.scheduler.last_epoch == straight.actor.scheduler.last_epoch == 2


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    cfg = load_config(None, CFG)
    TorchTrainWorker(tiny_model("qwen2", tie=True), cfg, total_steps=1).save_checkpoint(tmp_path / "ckpt")
    untied = TorchTrainWorker(tiny_model("qwen2", tie=False), cfg, total_steps=1)
    with pytest.raises(ValueError, match="does not match the model: missing \\['model.embed_tokens.weight'\\]"):
        untied.load_checkpoint(tmp_path / "ckpt")


def test_an_offloaded_reference_is_on_the_device_only_while_it_computes():
    from megarl.backends.offload import HostOffloaded

    model = tiny_model("qwen2")
    want = [t.clone() for t in model.parameters()]
    offloaded = HostOffloaded([model], "cpu")
    hosts = [t.data_ptr() for t in model.parameters()]
    assert hosts == [h.data_ptr() for h in offloaded.host[: len(hosts)]]  # parameters are the host copies
    with offloaded.on_device():
        inside = [t.data_ptr() for t in model.parameters()]
        assert not set(inside) & set(hosts)  # a device copy of every parameter (here: another CPU tensor)
        assert all(torch.equal(t, w) for t, w in zip(model.parameters(), want))
    assert [t.data_ptr() for t in model.parameters()] == hosts  # back to the host copies, the device copy freed


def test_the_cosine_schedule_spans_the_optimizer_steps_of_the_whole_run():
    # 2 training steps of 8 prompts in mini-batches of 4 prompts, 2 epochs: 2 x 2 x 2 = 8 optimizer
    # steps, over which the cosine (no warm-up, floor 0) runs: the factor of optimizer step k is
    # (1 + cos(pi k / 8)) / 2, worked out by hand below. Counting the training steps (2) instead had
    # it at the floor from optimizer step 2 on, three quarters of the run.
    cfg = load_config(None, CFG + ["data.train_batch_size=8", "data.gen_batch_size=8", "actor.optim.lr=1.0",
                                   "actor.optim.lr_scheduler=cosine", "actor.optim.min_lr_ratio=0.0",
                                   "actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2"])
    worker = TorchTrainWorker(tiny_model("qwen2"), cfg, total_steps=2)
    seen = []
    for _ in range(8):
        seen.append(worker.actor.scheduler.get_last_lr()[0])
        worker.actor.optimizer.step()
        worker.actor.scheduler.step()
    assert seen == pytest.approx([1.0, 0.961940, 0.853553, 0.691342, 0.5, 0.308658, 0.146447, 0.038060], abs=1e-6)

"""Data-parallel ranks with unequal work: more ranks than rows (the weights probe's 4 sequences at
DP 8 or 32), and ranks whose micro-batch counts differ while every MoE layer's expert-parallel
all-to-all spans them (EP across DP replicas, as the Qwen3-235B recipe lays it out). Every rank
runs the same number of micro-batches: a rank with fewer splits its own, a forward's rank with
no row to spare runs stand-in micro-batches whose results are dropped."""

import pytest
import torch

from megarl.backends.megatron.forward import plan_micro_batches
from megarl.backends.packed import PackedBatch
from megarl.backends.torch.logprobs import token_log_probs
from megatron_cases import forwards_whole_and_shared
from megatron_dist import run_distributed
from test_megatron_numerics import a_batch
from tiny_models import tiny_hf_model

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("lengths, size, budget, packed, count, want", [
    ([5, 3, 8, 2], 4, None, False, 2, [[0, 1], [2, 3]]),  # one group of 4 split in two halves
    ([5, 3, 8, 2], 2, None, False, 2, [[0, 1], [2, 3]]),  # already 2: unchanged
    ([5, 3, 8, 2], 2, None, False, 3, [[0, 1], [2], [3]]),  # the costlier group split (2 x 8 > 2 x 5)
    ([5, 3, 8], 3, None, False, 5, [[0], [1], [2]]),  # as far as rows go: 3 rows, 3 groups
    # dynamic, padded: [2, 0, 1, 3] fit 64 tokens (4 x 8); split by cost: rows x longest
    ([5, 3, 8, 2], 1, 64, False, 2, [[2, 0], [1, 3]]),
    ([5, 3, 8, 2], 1, 64, False, 3, [[2], [0], [1, 3]]),  # [2, 0] costs 16, [1, 3] 6
    # packed: [2, 0] (13 tokens), then [1, 3] (5): the larger one split first
    ([5, 3, 8, 2], 1, 13, True, 3, [[2], [0], [1, 3]]),
    ([], 2, None, False, 2, []),  # no rows: nothing to split
])
def test_a_plan_split_to_a_count_of_micro_batches(lengths, size, budget, packed, count, want):
    assert plan_micro_batches(lengths, micro_batch_size=size, max_tokens=budget, packed=packed, count=count) == want


def hf_log_probs(model, batch):
    with torch.no_grad():
        return token_log_probs(model, batch.input_ids, batch.attention_mask)[0]


def forwards_against_hf(tmp_path, family: str, rows: int, world: int, overrides: list[str]) -> list:
    """The first `rows` rows of a_batch, packed, through `forwards_whole_and_shared` on `world`
    ranks: each rank's log-probs of the whole batch and of its share, checked against the HF
    model's (position 0 of each row has none). Returns each rank's share."""
    model = tiny_hf_model(family)
    model.save_pretrained(tmp_path)
    padded = a_batch(model.config.vocab_size).select(slice(0, rows))
    batch = PackedBatch.from_rows(padded)
    want = batch.pack(hf_log_probs(model, padded))
    results = run_distributed(world, forwards_whole_and_shared, str(tmp_path), overrides, batch, timeout=120)
    real = torch.ones_like(batch.loss_mask)
    real[batch.starts()] = False
    for whole, _ in results:
        torch.testing.assert_close(whole[real], want[real], rtol=0, atol=1e-5)
    shares = [share for _, share in results]
    torch.testing.assert_close(torch.cat(shares)[real], want[real], rtol=0, atol=1e-5)
    return shares


def test_more_data_parallel_ranks_than_rows(tmp_path):
    # DP 4 over a batch of 2 rows (the probe's case at DP 8 or 32): ranks 0 and 2 have no row,
    # whether sent the whole batch (each takes its part) or only their share (the Ray proxy's way)
    shares = forwards_against_hf(tmp_path, "qwen2", 2, 4, [])
    assert [len(s) > 0 for s in shares] == [False, True, False, True]


EP2_OVER_DP2 = ["actor.parallel.expert_model_parallel_size=2", "actor.ppo_micro_batch_size=1"]


def test_expert_parallel_across_replicas_with_uneven_forward_shares(tmp_path):
    # EP 2 over the 2 DP ranks, 3 rows a micro-batch each: rank 0 has one row, rank 1 two, and
    # every MoE layer's all-to-all needs both ranks in it (today's main: neither rank answered)
    forwards_against_hf(tmp_path, "qwen3_moe", 3, 2, EP2_OVER_DP2)


def test_expert_parallel_across_replicas_with_uneven_dynamic_micro_batches(tmp_path):
    # One optimizer step, EP 2 over 2 DP ranks, packed micro-batches of at most 21 tokens: rank 0's
    # rows (14 and 7 tokens) fit one, rank 1's (19 and 5) need two; rank 0 splits its own in two
    # (one row each, as rank 1's), so the step equals the torch backend's at one row a micro-batch,
    # the load-balancing loss (0.01) included
    from megarl.backends.torch.actor import TorchActor
    from megarl.config import AlgorithmConfig, OptimConfig
    from megarl.models.hf_layout import checkpoint_views
    from megatron_cases import actor_step

    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    batch = a_batch(model.config.vocab_size)
    assert batch.attention_mask.sum(1).tolist() == [14, 7, 19, 5]
    g = torch.Generator().manual_seed(1)
    now = hf_log_probs(model, batch)
    batch = batch.with_fields(old_log_probs=now + 0.3 * torch.randn(now.shape, generator=g),
                              advantages=torch.randn(len(batch), 1, generator=g).expand_as(now).clone())
    algo = AlgorithmConfig()
    optim = OptimConfig(lr=1e-3, eps=1e-3, lr_warmup_steps=0, weight_decay=0.1, grad_clip=1.0)
    results = run_distributed(2, actor_step, str(tmp_path), dict(ep=2), batch, 1, algo, optim, 21, None, "mask",
                              timeout=120)
    actor = TorchActor(model, algo, optim, mini_batch_samples=len(batch), micro_batch_samples=1)
    assert actor.moe_aux_loss_coeff == 0.01
    want = actor.update_actor(batch)
    exported = {}
    for tensors, _ in results:
        exported.update(tensors)
    for name, tensor in checkpoint_views(model).items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-5, msg=name)
    for _, got in results:
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["moe_aux_loss"] == pytest.approx(want["moe_aux_loss"], rel=1e-5)


def test_small_collectives_go_where_the_backend_reduces(monkeypatch):
    # NCCL reduces CUDA tensors only (megatron's groups take the default backend: NCCL on GPUs)
    from megarl.backends.megatron.collectives import collective_device

    assert collective_device("gloo") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device("nccl") == torch.device("cuda", 3)

"""The megatron TrainWorker on CPU ranks (gloo): micro-batch planning, the critic against the
torch backend's, and distributed checkpoints that resume on another layout."""

import copy

import pytest
import torch

from megarl.backends.megatron.forward import plan_micro_batches
from megarl.backends.torch.logprobs import token_log_probs
from megatron_cases import checkpoint_phase, critic_update, shares_or_whole
from megatron_dist import run_distributed
from test_megatron_numerics import a_batch
from tiny_models import tiny_hf_model

pytestmark = pytest.mark.megatron  # megatron-core runs here: make test-compat runs these on its newest release too


@pytest.mark.parametrize("lengths, size, budget, multiple, packed, want", [
    ([5, 3, 8, 2], 2, None, 1, False, [[0, 1], [2, 3]]),  # fixed: consecutive rows
    ([5, 3, 8], 2, None, 1, False, [[0, 1], [2]]),  # the last micro-batch is short
    ([5, 3, 8], 2, None, 1, True, [[0, 1], [2]]),  # packed too
    ([14, 7, 19, 5], 1, 24, 1, False, [[2], [0], [1, 3]]),  # longest first; 2 x 14 > 24; 2 x 7 <= 24
    ([4, 4, 4, 4, 4], 1, 12, 1, False, [[0, 1, 2], [3, 4]]),  # 3 x 4 fits 12
    ([5, 5, 5], 1, 12, 4, False, [[0], [1], [2]]),  # rounded up to 8: 2 x 8 > 12
    ([30, 2], 1, 10, 1, False, [[0], [1]]),  # a row over the budget travels alone
    # packed, real tokens counted, first fit: 19 | 14 (33 > 24) | 7 joins 14 (21; 26 > 24 with 19) | 5 joins 19 (24)
    ([14, 7, 19, 5], 1, 24, 1, True, [[2, 3], [0, 1]]),
    ([5, 5, 5], 1, 12, 1, True, [[0, 1], [2]]),  # 10 <= 12
    ([5, 5, 5], 1, 12, 8, True, [[0], [1], [2]]),  # 10 rounds up to 16 > 12
    ([30, 2], 1, 10, 1, True, [[0], [1]]),
])
def test_plan_micro_batches(lengths, size, budget, multiple, packed, want):
    assert plan_micro_batches(lengths, micro_batch_size=size, max_tokens=budget, multiple=multiple,
                              packed=packed) == want


def test_packed_micro_batch_layout_by_hand():
    """Rows of 3 and 2 tokens packed at TP=2: [a0 a1 a2 b0 b1 pad], boundaries 0, 3, 5, 6."""
    from megarl.backends.batch import TrainBatch
    from megarl.backends.megatron.forward import block_causal_mask, make_micro_batches

    batch = TrainBatch.from_sequences([[11, 12], [21]], [[13], [22]], [[1], [1]])
    (micro,) = make_micro_batches(batch, [[0, 1]], multiple=2, packing="mask")
    assert micro.input_ids.tolist() == [[11, 12, 13, 21, 22, 0]]
    assert micro.position_ids.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert micro.targets.tolist() == [[12, 13, 0, 22, 0, 0]]
    assert micro.cu_seqlens.tolist() == [0, 3, 5, 6]
    allowed = ~block_causal_mask(micro.cu_seqlens)[0, 0]
    assert allowed.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                      [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    # output at each position -> token layout: entry t is the output at token t - 1
    per_position = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    assert micro.by_token(per_position).tolist() == [[0.0, 1.0, 2.0], [0.0, 4.0, 0.0]]
    (padded,) = make_micro_batches(batch, [[0, 1]], multiple=2, packing=None)
    assert padded.input_ids.tolist() == [[11, 12, 13, 0], [21, 22, 0, 0]]
    assert padded.targets.tolist() == [[12, 13, 0, 0], [22, 0, 0, 0]]
    assert padded.by_token(torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0]])).tolist() == \
        [[0.0, 1.0, 2.0], [0.0, 4.0, 5.0]]  # (padding beyond a row is masked by the callers)


def test_context_parallel_shares_of_a_packed_micro_batch_by_hand():
    """The packed row of the example above at CP=2 (padded to a multiple of 2 x CP = 4:
    [11 12 13 21 22 0 0 0]): rank 0 holds positions 0, 1, 6, 7 and rank 1 positions 2-5; each
    keeps the loss on the tokens predicted at its positions (token t at position t - 1)."""
    from megarl.backends.batch import TrainBatch
    from megarl.backends.megatron.forward import make_micro_batches

    batch = TrainBatch.from_sequences([[11, 12], [21]], [[13], [22]], [[1], [1]])
    (r0,) = make_micro_batches(batch, [[0, 1]], multiple=4, packing="mask", cp=2, cp_rank=0)
    (r1,) = make_micro_batches(batch, [[0, 1]], multiple=4, packing="mask", cp=2, cp_rank=1)
    assert r0.cu_seqlens.tolist() == r1.cu_seqlens.tolist() == [0, 3, 5, 8] and r0.seq_length == 8
    assert r0.owned.tolist() == [0, 1, 6, 7] and r1.owned.tolist() == [2, 3, 4, 5]
    assert r0.input_ids.tolist() == [[11, 12, 0, 0]] and r1.input_ids.tolist() == [[13, 21, 22, 0]]
    assert r0.targets.tolist() == [[12, 13, 0, 0]] and r1.targets.tolist() == [[0, 22, 0, 0]]
    # the response tokens are 13 (row 0, t = 2, position 1: rank 0) and 22 (row 1, t = 1, position 3: rank 1)
    assert r0.data.loss_mask.tolist() == [[0, 0, 1], [0, 0, 0]]
    assert r1.data.loss_mask.tolist() == [[0, 0, 0], [0, 1, 0]]
    assert r1.by_token(torch.tensor([[1.0, 2.0, 3.0, 4.0]])).tolist() == [[0.0, 0.0, 0.0], [0.0, 2.0, 0.0]]


@pytest.mark.parametrize("pack_sequences, impl, want", [
    (None, "transformer_engine", "thd"), (None, "local", None), (True, "local", "mask"),
    (True, "transformer_engine", "thd"), (False, "transformer_engine", None), (False, "local", None)])
def test_packing_follows_the_attention(pack_sequences, impl, want):
    from megarl.backends.megatron.forward import packing_for

    assert packing_for(pack_sequences, impl) == want


def returns_batch(vocab: int):
    batch = a_batch(vocab)
    g = torch.Generator().manual_seed(3)
    returns = torch.randn(len(batch), 1, generator=g).expand_as(batch.input_ids).clone() * batch.loss_mask
    return batch.with_fields(returns=returns)


@pytest.mark.parametrize("family, tied, parallel", [
    ("qwen2", False, ["actor.parallel.tensor_model_parallel_size=2"]),
    ("llama", True, ["actor.parallel.pipeline_model_parallel_size=2"]),
    ("qwen3", False, ["actor.parallel.tensor_model_parallel_size=2", "actor.pack_sequences=true",
                      "actor.max_tokens_per_gpu=24"]),  # packed micro-batches
    ("qwen2", True, ["actor.parallel.context_parallel_size=2"]),
])
def test_critic_update_equals_the_torch_backend(tmp_path, family, tied, parallel):
    from megarl.backends.torch.critic import TorchCritic
    from megarl.config import OptimConfig

    model = tiny_hf_model(family, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    batch = returns_batch(model.config.vocab_size)
    critic_parallel = [p.replace("actor.", "critic.") for p in parallel]
    overrides = parallel + critic_parallel + [
        "critic.enable=true", "critic.backend=megatron", "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size=1",
        "critic.optim.lr=1e-3", "critic.optim.eps=1e-3", "critic.optim.lr_warmup_steps=0", "critic.cliprange_value=0.5"]
    before, after, metrics = run_distributed(2, critic_update, str(tmp_path), overrides, batch)[0]

    optim = OptimConfig(lr=1e-3, eps=1e-3, lr_warmup_steps=0, weight_decay=0.01)
    critic = TorchCritic(copy.deepcopy(model), optim, cliprange_value=0.5, mini_batch_samples=4, micro_batch_samples=1)
    want_before = critic.compute_values(batch)
    want_metrics = critic.update_critic(batch.with_fields(values=want_before))
    want_after = critic.compute_values(batch)
    real = batch.attention_mask.bool().clone()  # megatron zeroes padding and position 0
    real[:, 0] = False
    assert torch.count_nonzero(want_before) == 0 and torch.count_nonzero(before) == 0  # both heads start at V = 0
    assert (want_after - want_before)[real].abs().max() > 1e-3  # the step moved the values
    torch.testing.assert_close(after[real], want_after[real], rtol=0, atol=2e-5)
    assert torch.count_nonzero(after[~real]) == 0
    assert metrics["vf_loss"] == pytest.approx(want_metrics["vf_loss"], rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(want_metrics["grad_norm"], rel=1e-4)


def update_batch(model, seed: int):
    """A batch with old log-probs near the model's and random per-row advantages."""
    g = torch.Generator().manual_seed(seed + 100)
    batch = a_batch(model.config.vocab_size, seed=seed)
    with torch.no_grad():
        now, _ = token_log_probs(model, batch.input_ids, batch.attention_mask)
    return batch.with_fields(old_log_probs=now + 0.1 * torch.randn(now.shape, generator=g),
                             advantages=torch.randn(len(batch), 1, generator=g).expand_as(now).clone())


TP2, PP2, DP2, CP2 = (["actor.parallel.tensor_model_parallel_size=2"], ["actor.parallel.pipeline_model_parallel_size=2"],
                      ["actor.parallel.data_parallel_size=2"], ["actor.parallel.context_parallel_size=2"])
PLAIN_ADAM = ["actor.parallel.use_distributed_optimizer=false"]


EP2 = ["actor.parallel.expert_model_parallel_size=2"]


@pytest.mark.parametrize("family, tied, saved_as, loaded_as", [
    ("qwen2", False, TP2, PP2), ("qwen3", True, DP2, TP2), ("llama", False, TP2 + PLAIN_ADAM, PP2 + PLAIN_ADAM),
    ("qwen2", True, CP2, DP2),
    ("qwen3_moe", False, EP2, DP2), pytest.param("qwen3_moe", True, DP2, EP2, marks=pytest.mark.full)])  # Qwen3-MoE: experts from 2 ranks to 1, and back
def test_checkpoint_resumes_on_another_layout_and_converts_to_hf(tmp_path, family, tied, saved_as, loaded_as):
    """Saved after one update, loaded in another layout: the same log-probs, and the next
    update (which needs Adam's moments and the step count back) lands on the same weights.
    DP=2 shards Adam's state over the two ranks; PLAIN_ADAM keeps it whole on every rank.
    ckpt_convert.megatron_to_hf turns the checkpoint into an HF model with the same log-probs."""
    from transformers import AutoModelForCausalLM

    from ckpt_convert.megatron_to_hf import convert

    model = tiny_hf_model(family, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "hf")
    first, second = update_batch(model, 1), update_batch(model, 2)
    hf, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    saved = run_distributed(2, checkpoint_phase, hf, saved_as, ckpt, True, first, second)[0]
    loaded = run_distributed(2, checkpoint_phase, hf, loaded_as, ckpt, False, first, second)[0]
    real = second.attention_mask.bool().clone()
    real[:, 0] = False
    torch.testing.assert_close(loaded[0][real], saved[0][real], rtol=0, atol=1e-5)
    assert (saved[1] - saved[0])[real].abs().max() > 1e-3  # the second update moved the log-probs
    torch.testing.assert_close(loaded[1][real], saved[1][real], rtol=0, atol=1e-5)
    assert loaded[2] == saved[2] == 2  # optimizer steps, the LR schedule's position

    convert(ckpt, tmp_path / "converted", hf_config=hf, progress=False)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    assert converted.config.tie_word_embeddings == tied
    with torch.no_grad():
        hf_log_probs, _ = token_log_probs(converted, second.input_ids, second.attention_mask)
    torch.testing.assert_close(hf_log_probs[real], saved[0][real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("parallel", [DP2, TP2])
def test_a_rank_sent_its_share_updates_as_one_sent_the_batch(tmp_path, parallel):
    """The Ray proxy sends each data-parallel rank only its rows (update_shares, forward_shares):
    the log-probs and the update equal those of every rank sent the whole batch. With TP 2 there
    is one data-parallel rank, whose share is the batch."""
    from megarl.backends.packed import PackedBatch

    model = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path)
    first, second = update_batch(model, 1), update_batch(model, 2)
    rows = TrainBatchCat(first, second)  # 8 rows: two mini-batches of 4 (rollout.n=2 x 2 prompts)
    batch = PackedBatch.from_rows(rows)
    whole = run_distributed(2, shares_or_whole, str(tmp_path), parallel, batch, False)
    shared = run_distributed(2, shares_or_whole, str(tmp_path), parallel, batch, True)
    real = batch.loss_mask.clone()
    real[batch.starts()] = False  # position 0 of each row has no log-prob
    dp = 2 if parallel == DP2 else 1
    cut = int(batch.lengths[: len(batch) // dp].sum())  # rank 0's rows of the forward share, when DP is 2
    torch.testing.assert_close(shared[0][0], whole[0][0][:cut] if dp == 2 else whole[0][0], rtol=0, atol=1e-6)
    if dp == 2:
        torch.testing.assert_close(shared[1][0], whole[1][0][cut:], rtol=0, atol=1e-6)
    assert (whole[0][1] - whole[0][0])[real].abs().max() > 1e-3  # the update moved the log-probs
    torch.testing.assert_close(shared[0][1][real], whole[0][1][real], rtol=0, atol=1e-6)
    for rank in (0, 1):  # the loss is normalised by the whole mini-batch's tokens on every rank
        assert shared[rank][2] == pytest.approx(whole[rank][2], rel=1e-6), rank


def TrainBatchCat(a, b):
    """Two TrainBatches' rows, padded to the longer."""
    from megarl.backends.batch import TrainBatch

    width = max(a.input_ids.shape[1], b.input_ids.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1])) if t is not None else None  # noqa: E731
    return TrainBatch(**{f: (torch.cat([pad(getattr(a, f)), pad(getattr(b, f))]) if getattr(a, f) is not None else None)
                         for f in ("input_ids", "attention_mask", "loss_mask", "old_log_probs", "advantages")})


def test_the_cosine_schedule_spans_the_optimizer_steps_of_the_whole_run():
    # as the torch backend's (test_backend_torch_worker.py): 2 training steps of 8 prompts in
    # mini-batches of 4, 2 epochs = 8 optimizer steps; factor (1 + cos(pi k / 8)) / 2 at step k
    from megarl.backends.megatron.worker import _Part
    from megarl.config import load_config

    cfg = load_config(None, ["data.train_batch_size=8", "data.gen_batch_size=8", "actor.optim.lr=1.0",
                             "actor.optim.lr_warmup_steps=0", "actor.optim.lr_scheduler=cosine",
                             "actor.optim.min_lr_ratio=0.0", "actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2"])
    part = _Part(chunks=[], model=[], optimizer=None, cfg=cfg.actor, batching={})
    seen = []
    for k in range(8):
        part.steps = k
        seen.append(part.lr(cfg, total_steps=2))
    assert seen == pytest.approx([1.0, 0.961940, 0.853553, 0.691342, 0.5, 0.308658, 0.146447, 0.038060], abs=1e-6)


@pytest.mark.parametrize("requested, fp8, cuda, te, want", [
    ("transformer_engine", None, True, True, "transformer_engine"),
    ("transformer_engine", None, False, False, "local"),  # a CPU machine: TE's layers need a GPU
    ("transformer_engine", None, False, True, "local"),
    ("local", None, True, True, "local"),  # asked for by name on a GPU
    ("local", None, True, False, "local"),
    ("transformer_engine", None, True, False, "does not import on this GPU machine"),  # no quiet fallback
    ("transformer_engine", "e4m3", True, False, "needs Transformer Engine on a GPU"),
    ("local", "hybrid", False, True, "needs Transformer Engine on a GPU"),
    ("te", None, True, True, "use transformer_engine or local"),
])
def test_the_layer_implementation_a_machine_gets(requested, fp8, cuda, te, want):
    from megarl.backends.megatron.layers import resolve_impl

    if want in ("transformer_engine", "local"):
        assert resolve_impl(requested, fp8, cuda=cuda, te=te) == want
    else:
        with pytest.raises((RuntimeError, ValueError), match=want):
            resolve_impl(requested, fp8, cuda=cuda, te=te)

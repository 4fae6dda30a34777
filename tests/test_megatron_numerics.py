"""The megatron backend against the HF model holding the same weights, on CPU (gloo, fp32),
as multi-process runs on localhost: log-probs and entropy within 1e-5, and HF → megatron
shards → HF export bit-exact, for TP=1, TP=2, PP=2, TP=2 x PP=2, PP=2 x VPP=2 and context
parallel CP=2 (also with TP=2 or PP=2), padded or packed; one optimizer step equals the torch
backend's."""

import pytest
import torch

from megarl.backends.batch import TrainBatch
from megarl.backends.torch.logprobs import token_log_probs
from megatron_cases import logprobs_and_export
from megatron_dist import run_distributed
from tiny_models import tiny_hf_model

pytestmark = pytest.mark.megatron  # megatron-core runs here: make test-compat runs these on its newest release too

LAYOUTS = {"tp1": dict(tp=1), "tp2": dict(tp=2), "pp2": dict(pp=2), "tp2pp2": dict(tp=2, pp=2),
           "pp2vpp2": dict(pp=2, vpp=2), "cp2": dict(cp=2), "tp2cp2": dict(tp=2, cp=2), "cp2pp2": dict(cp=2, pp=2)}


def a_batch(vocab: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = [(5, 9), (3, 4), (7, 12), (4, 1)]  # (prompt, response): rows of different lengths
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for _, r in lengths]
    return TrainBatch.from_sequences(prompts, responses, [[1] * len(r) for r in responses])


# max_tokens: dynamic micro-batches by a token budget; with the batch below (rows of 14, 7,
# 19 and 5 tokens) a budget of 24 gives micro-batches of rows [2], [0], [1, 3] and shapes
# (1, 19), (1, 14), (2, 7): different shapes through the pipeline. Packed ("mask": megatron's
# local layers with a block-diagonal mask) the same budget counts real tokens: rows [2, 3]
# (24 tokens) and [0, 1] (21, a 22-token row at TP=2 with a one-token padding segment), also
# through two pipeline stages
@pytest.mark.parametrize("family, tied, layout, max_tokens, packing", [
    ("qwen2", True, "tp1", None, None), ("qwen2", False, "tp2", None, None), ("llama", False, "pp2", 24, None),
    ("qwen3", True, "tp2pp2", 32, None), ("qwen3", False, "tp2", None, None), ("llama", True, "tp2pp2", None, None),
    ("qwen2", True, "pp2vpp2", None, None),
    ("qwen2", False, "tp1", None, "mask"), ("llama", True, "tp2", 24, "mask"), ("qwen3", False, "pp2", 24, "mask"),
    # context parallel: each sequence split over two ranks (load-balanced chunks)
    ("qwen2", True, "cp2", None, None), ("qwen3", True, "cp2pp2", None, None),
    ("qwen3", False, "cp2", None, "mask"), ("llama", True, "tp2cp2", 24, "mask"),  # packed rows split over CP
])
def test_log_probs_match_hf_and_export_is_exact(tmp_path, family, tied, layout, max_tokens, packing):
    model = tiny_hf_model(family, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    batch = a_batch(model.config.vocab_size)
    with torch.no_grad():
        want_lp, want_ent = token_log_probs(model, batch.input_ids, batch.attention_mask, with_entropy=True)
    kw = LAYOUTS[layout]
    world = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1)
    results = run_distributed(world, logprobs_and_export, str(tmp_path), kw, batch, 2, "float32", max_tokens, "local",
                              None, packing)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    exported = {}
    for log_probs, entropy, tensors in results:
        torch.testing.assert_close(log_probs[real], want_lp[real], rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy[real], want_ent[real], rtol=0, atol=1e-5)
        exported.update(tensors)
    state = {n: t for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("family, tied, layout, max_tokens, recompute, packing", [
    ("qwen2", False, dict(tp=2), None, None, None), ("llama", True, dict(pp=2), 24, None, None),
    ("qwen3", False, dict(tp=1, world=2), None, "full", None),  # DP=2 with full activation recomputation
    ("qwen2", True, dict(tp=2), 24, None, "mask"),  # packed micro-batches
    ("llama", False, dict(cp=2), None, None, None),  # context parallel: keys' and values' gradients summed over CP
    ("qwen2", False, dict(tp=1, world=1, offload=True), None, None, None)])  # optimizer offload: a no-op on a CPU
def test_one_optimizer_step_equals_the_torch_backend(tmp_path, family, tied, layout, max_tokens, recompute, packing):
    from megarl.backends.torch.actor import TorchActor
    from megarl.config import AlgorithmConfig, OptimConfig
    from megatron_cases import actor_step

    model = tiny_hf_model(family, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    batch = a_batch(model.config.vocab_size)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        now, _ = token_log_probs(model, batch.input_ids, batch.attention_mask)
    batch = batch.with_fields(old_log_probs=now + 0.3 * torch.randn(now.shape, generator=g),  # some ratios clip
                              advantages=torch.randn(len(batch), 1, generator=g).expand_as(now).clone())
    algo = AlgorithmConfig()  # DAPO: clip 0.2 / 0.28, token-mean
    # Adam's first step moves every weight by about lr * g / (|g| + eps): with a tiny eps a
    # weight whose gradient is near eps amplifies rounding noise up to lr, so a larger eps
    # makes the comparison well conditioned (an update error is then at most lr / eps times
    # the gradient error)
    optim = OptimConfig(lr=1e-3, eps=1e-3, lr_warmup_steps=0, weight_decay=0.1, grad_clip=1.0,
                        offload=layout.pop("offload", False))
    world = layout.pop("world", layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
    results = run_distributed(world, actor_step, str(tmp_path), layout, batch, 1, algo, optim, max_tokens, recompute,
                              packing)

    actor = TorchActor(model, algo, optim, mini_batch_samples=len(batch), micro_batch_samples=2)
    want = actor.update_actor(batch)
    exported = {}
    for tensors, _ in results:
        exported.update(tensors)
    state = {n: t for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-5, msg=name)
    got = results[-1][1]  # the last stage's metrics
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert want["clipfrac"] > 0 and got["clipfrac"] == pytest.approx(want["clipfrac"], abs=1e-6)

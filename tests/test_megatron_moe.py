"""Qwen3-MoE on the megatron backend against the HF model holding the same weights, on CPU
(gloo, fp32) as multi-process runs on localhost: megatron's all-to-all token dispatcher (the
one GPU runs use; megarl's CPU mode stands in for its CUDA streams), expert parallelism (EP)
alone and with tensor (TP) and pipeline (PP) parallelism. The tiny model has 6 experts (not a
power of two), top-2 routing, grouped-query attention and one dense layer among the MoE ones."""

import pytest
import torch

from megarl.backends.torch.logprobs import token_log_probs
from megatron_cases import logprobs_and_export
from megatron_dist import run_distributed
from test_megatron_numerics import a_batch
from tiny_models import tiny_hf_model

pytest.importorskip("megatron.core")

# world sizes: EP=2 alone (2 ranks); TP=2 with EP=2 over the two data-parallel replicas (4 ranks,
# expert TP 1); TP=2 with EP=2 folded into the TP ranks (2 ranks: megatron lays experts out apart
# from attention); PP=2 with EP=2 (4 ranks)
MOE_LAYOUTS = {"ep2": (dict(ep=2), 2), "tp2ep2": (dict(tp=2, ep=2, etp=1), 4),
               "tp2ep2_folded": (dict(tp=2, ep=2, etp=1), 2), "pp2ep2": (dict(pp=2, ep=2), 4)}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_log_probs_match_hf_and_export_is_exact(tmp_path, layout):
    from megarl.models.hf_layout import checkpoint_views

    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    batch = a_batch(model.config.vocab_size)
    with torch.no_grad():
        want_lp, want_ent = token_log_probs(model, batch.input_ids, batch.attention_mask, with_entropy=True)
    kw, world = MOE_LAYOUTS[layout]
    results = run_distributed(world, logprobs_and_export, str(tmp_path), kw, batch, 2)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    exported = {}
    for log_probs, entropy, tensors in results:
        torch.testing.assert_close(log_probs[real], want_lp[real], rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy[real], want_ent[real], rtol=0, atol=1e-5)
        exported.update(tensors)
    state = checkpoint_views(model)
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name

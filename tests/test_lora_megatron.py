"""LoRA on the megatron backend (megarl.backends.megatron.lora) against HF + PEFT holding the same
weights and adapters, on CPU (gloo, fp32) as multi-process runs: log-probs within 1e-5 at TP 2, PP 2
and EP 2, the base's without the adapters, the merged export equal to PEFT's merge, and the
adapters exported under PEFT's names exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from lora_cases import lora_logprobs
from megarl.backends.torch.logprobs import token_log_probs
from megatron_dist import run_distributed
from test_megatron_numerics import a_batch
from tiny_models import tiny_hf_model

pytestmark = pytest.mark.megatron

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(family: str, targets: list[str], tied: bool = False):
    """(the HF model, it with PEFT's adapters, A and B random: B is no longer zero)."""
    base = tiny_hf_model(family, tie_word_embeddings=tied)
    adapted = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return base, adapted.eval()


@pytest.mark.parametrize("family, layout, world, targets, tied", [
    ("qwen2", dict(tp=2), 2, ALL, False),
    ("qwen3", dict(pp=2), 2, ["q_proj", "v_proj", "down_proj"], True),
    ("llama", dict(tp=2, pp=2), 4, ["k_proj", "o_proj", "up_proj"], False),
    # a mixture of experts: attention only (PEFT would put its MLP targets on the experts' 3-D tensors)
    ("qwen3_moe", dict(ep=2), 2, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
])
def test_log_probs_and_merged_weights_match_hf_with_peft(tmp_path, family, layout, world, targets, tied):
    base, adapted = peft_model(family, targets, tied)
    base.save_pretrained(tmp_path)
    state = get_peft_model_state_dict(adapted)
    batch = a_batch(base.config.vocab_size)
    with torch.no_grad():
        want, _ = token_log_probs(adapted, batch.input_ids, batch.attention_mask)
        want_base, _ = token_log_probs(base, batch.input_ids, batch.attention_mask)
        merged_want = copy.deepcopy(adapted).merge_and_unload().state_dict()
    results = run_distributed(world, lora_logprobs, str(tmp_path), layout, batch,
                              dict(r=4, lora_alpha=8, target_modules=targets), state)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    merged, peft = {}, {}
    for with_adapters, without, stage_merged, stage_peft, frozen, trainable in results:
        torch.testing.assert_close(with_adapters[real], want[real], rtol=0, atol=1e-5)
        torch.testing.assert_close(without[real], want_base[real], rtol=0, atol=1e-5)
        assert frozen and trainable and all(".lora.by_name." in n for n in trainable)
        merged.update(stage_merged)
        peft.update(stage_peft)
    assert not torch.allclose(want[real], want_base[real], atol=1e-3)  # the adapters change the model
    from megarl.models.hf_layout import checkpoint_views

    views = checkpoint_views(base)
    assert merged.keys() == views.keys()
    for name in views:
        torch.testing.assert_close(merged[name], dict(checkpoint_views_of(merged_want, base))[name], rtol=0, atol=1e-6)
    assert peft.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(peft[name], tensor), name


def checkpoint_views_of(state: dict, like):
    """PEFT's merged state dict under the HF checkpoint's names (the model `like` gives the layout)."""
    from megarl.models.hf_layout import checkpoint_views

    model = copy.deepcopy(like)
    model.load_state_dict(state, strict=False)
    return checkpoint_views(model).items()

"""megarl.models: HF config → ModelSpec, and the HF ⇄ Megatron tensor mapping (no megatron needed)."""

import pytest
import torch

from megarl.models import ModelSpec, UnsupportedModel, rope_inv_freq
from megarl.models.mapping import all_rules, hf_from_shards, hf_names, shard_from_hf
from tiny_models import tiny_hf_config, tiny_hf_model


def spec_of(family, **kw):
    return ModelSpec.from_hf(tiny_hf_config(family, **kw))


def test_qkv_layout_by_hand():
    # 4 query heads in 2 groups, head_dim 1, hidden 1: q = [q0..q3], k = [k0, k1], v = [v0, v1]
    spec = ModelSpec("qwen2", 10, 1, 2, 1, num_heads=4, num_kv_heads=2, head_dim=1, norm_eps=1e-6,
                     rope_theta=1e4, max_position_embeddings=8, tied_embeddings=True, qkv_bias=True, qk_norm=False)
    (rule,) = [r for r in all_rules(spec) if r.megatron.endswith("linear_qkv.bias")]
    q, k, v = torch.tensor([0., 1., 2., 3.]), torch.tensor([10., 11.]), torch.tensor([20., 21.])
    named = dict(zip(rule.hf, (q, k, v)))
    assert shard_from_hf(rule, named, spec, 0, 1).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert shard_from_hf(rule, named, spec, 0, 2).tolist() == [0, 1, 10, 20]
    assert shard_from_hf(rule, named, spec, 1, 2).tolist() == [2, 3, 11, 21]


def test_glu_and_vocab_layout_by_hand():
    spec = spec_of("llama")
    fc1 = next(r for r in all_rules(spec) if r.megatron.endswith("linear_fc1.weight"))
    gate = torch.arange(4.)[:, None].expand(4, spec.hidden_size) * 1.0
    up = gate + 100
    shard1 = shard_from_hf(fc1, dict(zip(fc1.hf, (gate, up))), spec, 1, 2)
    assert shard1[:, 0].tolist() == [2, 3, 102, 103]
    emb = next(r for r in all_rules(spec) if r.vocab)
    table = torch.randn(spec.vocab_size, spec.hidden_size)
    assert spec.vocab_size == 300 and spec.padded_vocab_size(2) == 512
    s0, s1 = (shard_from_hf(emb, {emb.hf[0]: table}, spec, r, 2) for r in (0, 1))
    assert s0.shape == s1.shape == (256, spec.hidden_size)
    assert torch.equal(s1[: 300 - 256], table[256:]) and not s1[300 - 256:].any()


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_shards_to_hf_is_bit_exact(family, tied, tp):
    model = tiny_hf_model(family, tie_word_embeddings=tied)
    spec = ModelSpec.from_hf(model.config)
    state = {n: t for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    assert sorted(hf_names(spec)) == sorted(state)
    back = {}
    for rule in all_rules(spec):
        back.update(hf_from_shards(rule, [shard_from_hf(rule, state, spec, r, tp) for r in range(tp)], spec))
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_spec_reads_the_families():
    q2, l3, q3 = spec_of("qwen2"), spec_of("llama"), spec_of("qwen3")
    assert (q2.qkv_bias, q2.qk_norm, l3.qkv_bias, q3.qk_norm) == (True, False, False, True)
    assert q3.head_dim == 24 and q3.head_dim * q3.num_heads != q3.hidden_size  # Qwen3's explicit head_dim
    assert l3.rope_scaling is not None and l3.num_kv_heads == 2


def test_llama3_rope_frequencies_match_transformers():
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_hf_config("llama")
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.for_model(**config), "cpu")
    assert torch.allclose(rope_inv_freq(ModelSpec.from_hf(config)), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
])
def test_unsupported_configs_say_what(change, words):
    with pytest.raises(UnsupportedModel, match=words):
        ModelSpec.from_hf({**tiny_hf_config("qwen2"), **change})

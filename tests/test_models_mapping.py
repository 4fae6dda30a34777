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


# ---- mixture of experts (Qwen3-MoE) ----

def test_spec_reads_qwen3_moe():
    spec = spec_of("qwen3_moe")
    assert spec.is_moe and (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size) == (6, 2, 40)
    assert spec.moe_layers == (0, 2, 3) and spec.moe_norm_topk and spec.qk_norm and spec.router_aux_loss_coef == 0.01
    # HF's rule: experts where (layer + 1) % decoder_sparse_step == 0, unless listed dense
    assert spec_of("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[]).moe_layers == (1, 3)
    assert not spec_of("qwen3").is_moe


@pytest.mark.parametrize("change, words", [
    ({"model_type": "qwen2_moe"}, "Qwen2-MoE .*only mixture-of-experts family megarl maps is qwen3_moe"),
    ({"model_type": "mixtral"}, "Mixtral"),
    ({"shared_expert_intermediate_size": 64}, "shared experts"),
    ({"num_experts_per_tok": 7}, "num_experts_per_tok=7 is more than num_experts=6"),
    ({"moe_intermediate_size": None}, "without \\['moe_intermediate_size'\\]"),
    ({"mlp_only_layers": [0, 1, 2, 3]}, "no layer has experts"),
])
def test_unsupported_moe_configs_say_what(change, words):
    with pytest.raises(UnsupportedModel, match=words):
        ModelSpec.from_hf({**tiny_hf_config("qwen3_moe"), **change})


def test_moe_layer_rules_by_hand():
    from megarl.models.mapping import experts_of_rank, layer_rules, local_expert_name

    spec = spec_of("qwen3_moe")
    names = [r.megatron for r in layer_rules(spec, 0)]
    assert "decoder.layers.0.mlp.router.weight" in names and "decoder.layers.0.mlp.linear_fc1.weight" not in names
    assert [r.megatron for r in layer_rules(spec, 1)][-2:] == ["decoder.layers.1.mlp.linear_fc1.weight",
                                                               "decoder.layers.1.mlp.linear_fc2.weight"]  # dense
    fc1 = next(r for r in layer_rules(spec, 2) if r.expert == 4 and r.megatron.endswith("linear_fc1.weight"))
    assert fc1.hf == ("model.layers.2.mlp.experts.4.gate_proj.weight", "model.layers.2.mlp.experts.4.up_proj.weight")
    # 6 experts over EP=3: rank 2 holds experts 4 and 5, expert 4 as its local expert 0
    assert list(experts_of_rank(spec, 2, 3)) == [4, 5]
    assert local_expert_name(fc1.megatron, 0) == "decoder.layers.2.mlp.experts.local_experts.0.linear_fc1.weight"
    assert local_expert_name(fc1.megatron, 0, grouped=True) == "decoder.layers.2.mlp.experts.linear_fc1.weight0"
    # expert TP 2: rank 1 holds the second half of the gate rows, then the second half of the up rows
    gate = torch.arange(40.)[:, None].expand(40, spec.hidden_size)
    shard = shard_from_hf(fc1, dict(zip(fc1.hf, (gate, gate + 100))), spec, 1, 2)
    assert shard[:, 0].tolist() == list(range(20, 40)) + list(range(120, 140))


@pytest.mark.parametrize("etp", [1, 2])
def test_moe_hf_to_shards_to_hf_is_bit_exact(etp):
    from megarl.models.hf_layout import checkpoint_views

    model = tiny_hf_model("qwen3_moe")
    spec = ModelSpec.from_hf(model.config)
    state = checkpoint_views(model)
    assert sorted(hf_names(spec)) == sorted(state)
    back = {}
    for rule in all_rules(spec):
        back.update(hf_from_shards(rule, [shard_from_hf(rule, state, spec, r, etp) for r in range(etp)], spec))
    assert back.keys() == state.keys() and all(torch.equal(back[n], t) for n, t in state.items())


def test_checkpoint_views_are_the_checkpoint_and_write_through(tmp_path):
    from safetensors.torch import load_file

    from megarl.models.hf_layout import checkpoint_views

    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path)  # transformers writes the per-expert checkpoint layout itself
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    views = checkpoint_views(model)
    assert sorted(views) == sorted(on_disk) and "model.layers.0.mlp.experts.5.up_proj.weight" in views
    assert all(torch.equal(views[n], t) for n, t in on_disk.items())
    with torch.no_grad():
        views["model.layers.2.mlp.experts.3.up_proj.weight"].fill_(0.5)
    fused = model.model.layers[2].mlp.experts.gate_up_proj
    assert bool((fused[3, 40:] == 0.5).all()) and not bool((fused[3, :40] == 0.5).any())

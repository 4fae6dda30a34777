"""Tiny models and a locally trained tokenizer for tests (nothing is downloaded).

`tiny_hf_config` / `tiny_hf_model` give the megatron tests odd sizes on purpose: grouped-query
heads, a vocabulary that is not a multiple of 128, Qwen3's head_dim that is not hidden /
heads, Llama 3 rope scaling, and random biases and norms."""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from megarl.data.tokenizer import train_bpe_tokenizer

TEXT = [
    "<think> I need to search </think> <search> capital of Zorbia </search> <information> Doc 1 </information>",
    "<answer> Paris </answer> The answer is 42. Answer: 7 Zürich 東京 naïve café",
    "the quick brown fox jumps over the lazy dog 0123456789 + - * / = ( ) { } \\boxed",
] * 20


def tiny_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    return train_bpe_tokenizer(TEXT, vocab_size)


def tiny_model(family: str = "qwen2", vocab_size: int = 300, tie: bool = False, seed: int = 0, eos_token_id=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=tie, eos_token_id=eos_token_id)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()
    if family == "llama":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        return LlamaForCausalLM(LlamaConfig(rope_scaling=scaling, **common)).eval()
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=16, num_experts=6, num_experts_per_tok=2,
                                                   moe_intermediate_size=40, norm_topk_prob=True,
                                                   router_aux_loss_coef=0.01, **common))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_()  # a decisive router: no near-ties between experts
        return model.eval()
    raise ValueError(family)


def reference_log_probs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of `output` after `prompt` from one plain forward pass (the slow reference)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


# ---- configs and models for the megatron backend's tests ----

_BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu",
             tie_word_embeddings=False)
_FAMILY = {
    "qwen2": dict(model_type="qwen2", rope_theta=10000.0),
    "llama": dict(model_type="llama", rope_theta=500000.0, attention_bias=False, mlp_bias=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(model_type="qwen3", rope_theta=1000000.0, head_dim=24, attention_bias=False),
    # odd sizes: 6 experts (not a power of two), top-2, GQA, and layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(model_type="qwen3_moe", rope_theta=1000000.0, head_dim=24, attention_bias=False,
                      num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.01),
}


def tiny_hf_config(family: str, **overrides) -> dict:
    return {**_BASE, **_FAMILY[family], **overrides}


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    """A randomly initialised HF model (fp32); biases and norms get random values too, so a
    wrong mapping of any of them shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # a decisive router: no near-ties between experts
                p.copy_(torch.randn_like(p))
    return model.eval()

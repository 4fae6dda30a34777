"""Tiny HF configs and models of the supported families, with odd sizes on purpose:
grouped-query heads, a vocabulary that is not a multiple of 128, Qwen3's head_dim that is
not hidden / heads, Llama 3 rope scaling."""

from __future__ import annotations

import torch

_BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu",
             tie_word_embeddings=False)
_FAMILY = {
    "qwen2": dict(model_type="qwen2", rope_theta=10000.0),
    "llama": dict(model_type="llama", rope_theta=500000.0, attention_bias=False, mlp_bias=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(model_type="qwen3", rope_theta=1000000.0, head_dim=24, attention_bias=False),
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
    return model.eval()

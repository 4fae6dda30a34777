"""What megarl needs to know about a decoder model, read from its HF `config.json`.

`ModelSpec.from_hf(config)` accepts a dict, a path to a directory or config.json, or a
transformers config object, and raises `UnsupportedModel` naming every feature it cannot
map (a sliding window, biases on the output projection, an activation other than SwiGLU,
an unknown rope type, shared experts, ...). Families: Qwen2 / Qwen2.5 (QKV bias), Llama 3
(llama3 rope scaling), Qwen3 (QK RMSNorm, explicit head_dim), and Qwen3-MoE (Qwen3's attention;
top-k routed SwiGLU experts, no shared expert, optionally some dense layers); tied or untied
embeddings.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The model families megarl supports, HF model_type -> architecture: the one list, also read by
# the embedded engine (megarl.rollout.decoder).
FAMILIES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_FAMILIES = ("qwen3_moe",)
# mixture-of-experts families megarl does not map, named in the refusal
_OTHER_MOE = {"qwen2_moe": "Qwen2-MoE (shared experts)", "mixtral": "Mixtral", "deepseek_v2": "DeepSeek-V2",
              "deepseek_v3": "DeepSeek-V3", "olmoe": "OLMoE", "gpt_oss": "gpt-oss", "llama4": "Llama 4"}
VOCAB_MULTIPLE = 128  # megatron pads the vocabulary to a multiple of this times TP


class UnsupportedModel(ValueError):
    """The HF config describes a model megarl cannot map to megatron-core."""


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: tuple[tuple[str, float], ...] | None = None  # llama3 parameters, sorted items
    # mixture of experts (0 experts: a dense model)
    num_experts: int = 0
    moe_topk: int = 0  # experts each token is routed to
    moe_ffn_hidden_size: int = 0  # each expert's intermediate size
    moe_norm_topk: bool = False  # the top-k routing weights renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts (the others are dense)
    router_aux_loss_coef: float = 0.0  # the HF config's load-balancing loss coefficient

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's embedding rows: the vocabulary rounded up to a multiple of 128 * TP."""
        multiple = VOCAB_MULTIPLE * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    @classmethod
    def from_hf(cls, config: Any) -> ModelSpec:
        c = _as_dict(config)
        family = c.get("model_type")
        if family in _OTHER_MOE:
            raise UnsupportedModel(f"model_type {family!r} ({_OTHER_MOE[family]}) is not supported: the only "
                                   f"mixture-of-experts family megarl maps is qwen3_moe (Qwen3MoeForCausalLM)")
        if family not in FAMILIES:
            raise UnsupportedModel(f"model_type {family!r} is not supported; megarl maps {sorted(FAMILIES)} "
                                   f"({', '.join(FAMILIES.values())})")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if c.get(k) is None]
        if missing:
            raise UnsupportedModel(f"{family} config lacks {missing}")
        problems = []
        if c.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={c['hidden_act']!r} (only SwiGLU with silu is mapped)")
        if c.get("use_sliding_window"):
            problems.append("use_sliding_window=true (sliding-window attention)")
        if c.get("mlp_bias"):
            problems.append("mlp_bias=true (biases on the MLP)")
        if family in ("llama", "qwen3", "qwen3_moe") and c.get("attention_bias"):
            problems.append("attention_bias=true (megatron-core has no bias on the output projection alone)")
        heads = c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        if heads % kv:
            problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        theta, scaling = _rope(c, problems)
        moe = _experts(c, problems) if family in MOE_FAMILIES else {}
        if problems:
            raise UnsupportedModel(f"{family} model with unsupported features: " + "; ".join(problems))
        return cls(family=family, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                   ffn_hidden_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=kv, head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=theta,
                   max_position_embeddings=c.get("max_position_embeddings", 4096),
                   tied_embeddings=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "qwen3_moe"), rope_scaling=scaling, **moe)


def rope_inv_freq(spec: ModelSpec):
    """The rotary inverse frequencies as HF computes them (default, or llama3 scaling)."""
    import torch

    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if spec.rope_scaling is None:
        return inv
    p = dict(spec.rope_scaling)
    old = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / p["low_freq_factor"], old / p["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / p["factor"], inv)
    smooth = (old / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / p["factor"] + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _experts(c: dict, problems: list[str]) -> dict[str, Any]:
    """The ModelSpec fields of a Qwen3-MoE config (problems appended to `problems`)."""
    # the Hub's configs say num_experts; transformers 5 writes the same number as num_local_experts
    c = {**c, "num_experts": c.get("num_experts") or c.get("num_local_experts")}
    absent = [k for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size") if not c.get(k)]
    if absent:
        problems.append(f"a mixture of experts without {absent}")
        return {}
    experts, topk = c["num_experts"], c["num_experts_per_tok"]
    if topk > experts:
        problems.append(f"num_experts_per_tok={topk} is more than num_experts={experts}")
    if c.get("shared_expert_intermediate_size"):
        problems.append("shared_expert_intermediate_size set (shared experts are not mapped)")
    step = c.get("decoder_sparse_step") or 1
    dense = set(c.get("mlp_only_layers") or ())
    # the HF rule (Qwen3MoeDecoderLayer): experts where the layer is not listed dense and
    # (layer + 1) is a multiple of decoder_sparse_step
    layers = tuple(i for i in range(c["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    if not layers:
        problems.append("no layer has experts (mlp_only_layers / decoder_sparse_step leave every layer dense)")
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=c["moe_intermediate_size"],
                moe_norm_topk=bool(c.get("norm_topk_prob", False)), moe_layers=layers,
                router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.0) or 0.0))


def _rope(c: dict, problems: list[str]) -> tuple[float, tuple[tuple[str, float], ...] | None]:
    params = dict(c.get("rope_parameters") or {})  # transformers 5
    scaling = c.get("rope_scaling") or ({k: v for k, v in params.items() if k != "rope_theta"} or None)
    theta = c.get("rope_theta") or params.get("rope_theta") or 10000.0
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        problems.append(f"rope_type={kind!r} (only default and llama3 rope are mapped)")
        return float(theta), None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    absent = [k for k in keys if k not in scaling]
    if absent:
        problems.append(f"llama3 rope scaling without {absent}")
        return float(theta), None
    return float(theta), tuple(sorted((k, float(scaling[k])) for k in keys))


def _as_dict(config: Any) -> dict:
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise FileNotFoundError(f"no HF config at {path}")
        return json.loads(path.read_text())
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"expected an HF config (dict, path or PretrainedConfig), got {type(config).__name__}")

"""The models `megarl plan` sizes: public HF configs of the recipes' models, and the parameter
and activation counts the estimates need (megarl.planner has the formulas).

A mixture of experts' layer holds its attention, a router (E x h) and E experts of 3 h I
parameters each; expert parallelism splits the experts, tensor parallelism the rest. Its
activations per token hold, in place of the dense MLP's 3 f, the k experts' gate/up and product
(3 k I) and the token's copies sent to and back from them by the all-to-all (2 k h).
Main entry point: `ModelShape`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models.spec import ModelSpec

# Public HF configs of the models megarl's recipes use (no hub access is needed to plan them).
KNOWN_MODELS = {
    "Qwen/Qwen2.5-7B": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                            tie_word_embeddings=False),
    "Qwen/Qwen2.5-32B": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                             num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                             tie_word_embeddings=False),
    "Qwen/Qwen2.5-72B": dict(model_type="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                             num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                             tie_word_embeddings=False),
    "Qwen/Qwen3-8B": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                          num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          tie_word_embeddings=False),
    "Qwen/Qwen3-32B": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                           num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                           tie_word_embeddings=False),
    "meta-llama/Llama-3.1-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                    num_key_value_heads=8, tie_word_embeddings=False),
    # mixtures of experts: every layer routes each token to 8 of 128 experts
    "Qwen/Qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                               norm_topk_prob=True, tie_word_embeddings=False),
    "Qwen/Qwen3-235B-A22B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096,
                                 intermediate_size=12288, num_hidden_layers=94, num_attention_heads=64,
                                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=1536, norm_topk_prob=True, tie_word_embeddings=False),
    "meta-llama/Llama-3.1-70B": dict(model_type="llama", vocab_size=128256, hidden_size=8192,
                                     intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                                     num_key_value_heads=8, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes the estimates need, from a ModelSpec."""

    spec: ModelSpec

    @classmethod
    def load(cls, name_or_path: str) -> ModelShape:
        """A known model name (KNOWN_MODELS, case-insensitive, with or without the org) or an
        HF config.json / model directory."""
        wanted = name_or_path.lower()
        for name, config in KNOWN_MODELS.items():
            if wanted in (name.lower(), name.split("/")[1].lower()):
                return cls(ModelSpec.from_hf(config))
        try:
            return cls(ModelSpec.from_hf(name_or_path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{name_or_path!r} is neither an HF config / model directory nor a known model "
                                    f"({', '.join(KNOWN_MODELS)})") from None

    def attention_params(self) -> int:
        """A layer's attention and its two norms (and QK norms)."""
        s = self.spec
        h, d, q, kv = s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads
        attention = h * q * d + 2 * h * kv * d + q * d * h + ((q + 2 * kv) * d if s.qkv_bias else 0)
        return attention + 2 * h + (2 * d if s.qk_norm else 0)

    def expert_params(self, layer: int) -> int:
        """The experts of `layer` (0 for a dense layer)."""
        s = self.spec
        return s.num_experts * 3 * s.hidden_size * s.moe_ffn_hidden_size if s.is_moe_layer(layer) else 0

    def layer_params(self, layer: int = 0) -> int:
        s = self.spec
        if s.is_moe_layer(layer):
            return self.attention_params() + s.num_experts * s.hidden_size + self.expert_params(layer)
        return self.attention_params() + 3 * s.hidden_size * s.ffn_hidden_size

    def params(self) -> int:
        """All parameters as in the HF checkpoint (a tied output layer counted once)."""
        s = self.spec
        embeddings = s.vocab_size * s.hidden_size * (1 if s.tied_embeddings else 2)
        return sum(self.layer_params(i) for i in range(s.num_layers)) + embeddings + s.hidden_size

    def stage_split(self, tp: int, pp: int) -> tuple[int, int]:
        """(parameters that are not experts, expert parameters) of the largest pipeline stage
        (padded vocabulary; with PP > 1 a tied output layer has its own copy on the last stage,
        as megatron keeps it)."""
        s = self.spec
        per = s.num_layers // pp
        table = s.padded_vocab_size(tp) * s.hidden_size
        best = (0, 0)
        for stage in range(pp):
            layers = range(stage * per, (stage + 1) * per)
            experts = sum(self.expert_params(i) for i in layers)
            rest = sum(self.layer_params(i) for i in layers) - experts
            if pp == 1:
                rest += table * (1 if s.tied_embeddings else 2) + s.hidden_size
            elif stage in (0, pp - 1):
                rest += table + (s.hidden_size if stage == pp - 1 else 0)
            best = max(best, (rest, experts), key=sum)
        return best

    def stage_params(self, tp: int, pp: int) -> int:
        """Parameters of the largest pipeline stage (see stage_split)."""
        return sum(self.stage_split(tp, pp))

    def lora_params(self, layer: int, tp: int, rank: int, modules: tuple[str, ...]) -> float:
        """One GPU's LoRA adapter parameters of `layer` (rank `rank` on the HF linear layers `modules`),
        sharded as their layer is: a column-parallel layer's A (r x in) whole and its B (out / TP x r)
        split, a row-parallel layer's A (r x in / TP) split and its B (out x r) whole. A mixture of
        experts' MLP gets none (its experts are not adapted)."""
        from megarl.config_lora import MLP_MODULES, SPLIT, module_shape

        total = 0.0
        for name in modules:
            if self.spec.is_moe_layer(layer) and name in MLP_MODULES:
                continue
            fan_in, fan_out = module_shape(self.spec, name)
            total += rank * (fan_in + fan_out / tp) if SPLIT[name] == "column" else rank * (fan_in / tp + fan_out)
        return total

    def stage_lora_params(self, tp: int, pp: int, rank: int, modules: tuple[str, ...]) -> float:
        """One GPU's adapter parameters in the largest pipeline stage (layers split evenly)."""
        per = self.spec.num_layers // pp
        return max(sum(self.lora_params(i, tp, rank, modules) for i in range(stage * per, (stage + 1) * per))
                   for stage in range(pp))

    def activation_width(self, layer: int = 0) -> int:
        """Values kept per token by one layer's forward for its backward (see the module docstring)."""
        s = self.spec
        mlp = 3 * s.moe_topk * s.moe_ffn_hidden_size + 2 * s.moe_topk * s.hidden_size if s.is_moe_layer(layer) \
            else 3 * s.ffn_hidden_size
        return 4 * s.hidden_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim + mlp

    def activation_bytes_per_layer(self, tokens: int, tp: int, layer: int = 0) -> int:
        return 2 * tokens * self.activation_width(layer) // tp

    def kv_bytes_per_token(self, engine_tp: int) -> int:
        s = self.spec
        return 2 * s.num_layers * max(s.num_kv_heads // engine_tp, 1) * s.head_dim * 2

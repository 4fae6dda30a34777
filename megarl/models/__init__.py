"""Per-family HF ⇄ Megatron model knowledge: `ModelSpec` (what the HF config says) and the
tensor mapping (`megarl.models.mapping`), the one source of truth for loading, export,
checkpoint conversion and weight sync."""

from megarl.models.spec import FAMILIES, ModelSpec, UnsupportedModel, rope_inv_freq

__all__ = ["FAMILIES", "ModelSpec", "UnsupportedModel", "rope_inv_freq"]

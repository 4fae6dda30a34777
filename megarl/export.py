"""`megarl export`: a trainer checkpoint -> an HF model directory (safetensors, config, tokenizer).

Reads the run's resolved config (for the base model's architecture and tokenizer) and the
checkpoint's actor weights (the torch backend's safetensors, or the megatron backend's
distributed checkpoint in any layout), its files verified first (megarl.checkpoint.verify).
Main entry point: `export_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

from megarl import checkpoint
from megarl.config import load_config


def export_checkpoint(run_dir: str | Path, out_dir: str | Path, step_dir: str | Path | None = None) -> Path:
    import torch
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megarl.models.hf_layout import checkpoint_views

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml", [])
    if step_dir:
        source = Path(step_dir)
        checkpoint.verify(source)
    else:
        source = checkpoint.newest_intact(run_dir / "checkpoints")  # a damaged newer one skipped, with a warning
    if source is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir / 'checkpoints'}")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path))
    if (source / "megatron_trainer.json").exists():  # written by actor.backend=megatron, any layout
        from megarl.backends.megatron.dist_format import actor_checkpoint, read_hf_tensors
        from megarl.models import ModelSpec

        # checkpoint names (per expert in a mixture of experts): copied into the model's own layout
        state = dict(read_hf_tensors(actor_checkpoint(source), ModelSpec.from_hf(cfg.model.path)))
        views = checkpoint_views(model)
        missing, unexpected = [n for n in views if n not in state], [n for n in state if n not in views]
        if not missing and not unexpected:
            with torch.no_grad():
                for name, tensor in state.items():
                    views[name].copy_(tensor)
    else:  # the torch backend's: the model's own names
        # saved with safetensors' save_model, which keeps one name of tied weights (either one):
        # its load_model fills the others
        missing, unexpected = load_model(model, str(source / "actor.safetensors"), strict=False)
        missing, unexpected = list(missing), list(unexpected)
    if missing or unexpected:
        raise ValueError(f"{source} does not fit {cfg.model.path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path).save_pretrained(out_dir)
    return out_dir
